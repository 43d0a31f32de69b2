"""Plugin off means vLLM unchanged, at the engine: with acespec installed (its two vLLM entry points
loaded in every vLLM process) and no rule asked for, vLLM's speculative decoding gives bit for bit what
it gives with acespec's entry points hidden, greedy and seeded sampling alike.

"Hidden" is what vLLM can see of an uninstalled package: vLLM finds plugins only through
`importlib.metadata.entry_points`, so the second run puts a `sitecustomize` first on PYTHONPATH (every
process vLLM spawns inherits it) under which acespec's distribution has no `entry_points.txt`. Each run is
its own interpreter, as two installs would be, running vLLM's engine and worker in that one process,
where the run first repairs vLLM's CPU expand kernel (without it, vLLM's own sampled speculative rows
are uninitialised memory, so no two runs agree, plugin or not). The drafter is vLLM's own `draft_model` method with
probabilistic drafting, so the rejection sampler's full path runs: drafter rows, recovered tokens,
bonus tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("ACESPEC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup.sh vllm makes .venv-vllm)")
pytest.importorskip("transformers")

pytestmark = pytest.mark.vllm

HIDE = '''
import importlib.metadata as _md

_read = _md.PathDistribution.read_text


def _read_text(self, filename):
    # acespec's distribution without its entry_points.txt: what vLLM would find were it not installed
    if filename == "entry_points.txt" and (self.metadata["Name"] or "").lower() == "acespec":
        return None
    return _read(self, filename)


_md.PathDistribution.read_text = _read_text
'''

RUN = '''
import json, sys


def main():
    from vllm import LLM, SamplingParams

    target, draft, out = sys.argv[1:4]
    import acespec.cloud.vllm_plugin as plugin
    import importlib.metadata as md
    from acespec.cloud.vllm_proposer import ensure_expand_is_right


    seen = sorted(ep.value for g in ("vllm.general_plugins", "vllm.logits_processors") for ep in md.entry_points(group=g)
                  if ep.value.startswith("acespec."))
    llm = LLM(model=target, skip_tokenizer_init=True, max_model_len=256, dtype="float32", block_size=32, enforce_eager=True,
              max_num_seqs=8, seed=0, gpu_memory_utilization=0.1, distributed_executor_backend="uni", speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                                          "draft_sample_method": "probabilistic"})
    # vLLM 0.32's CPU expand kernel leaves sampled speculative rows uninitialised (docs/operate/vllm.md):
    # without the repair its sampled outputs are not even the same from run to run, so both runs have it
    # (once the engine, in this process, has set up its kernels)
    ensure_expand_is_right()
    prompts = [{"prompt_token_ids": [(7 * i + j) % 512 for j in range(5 + 3 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, detokenize=False, ignore_eos=True, logprobs=2)] * 3 + [
        SamplingParams(temperature=t, max_tokens=24, seed=100 + i, detokenize=False, ignore_eos=True, logprobs=2)
        for i, t in enumerate([1.0, 0.7, 0.5])]
    res = llm.generate(prompts, params)
    outs = [{"ids": list(r.outputs[0].token_ids),
             "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in r.outputs[0].logprobs]} for r in res]
    json.dump({"entry_points": seen, "patched": plugin._state["patched"], "outputs": outs}, open(out, "w"))


if __name__ == "__main__":
    main()
'''


def test_no_rule_asked_for_gives_vllms_own_outputs_bit_for_bit(tmp_path):
    from acespec.models.synthetic import save_random_qwen2

    target = save_random_qwen2(tmp_path / "target", seed=0)
    draft = save_random_qwen2(tmp_path / "draft", seed=0, head_scale=10.0)
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    (tmp_path / "run.py").write_text(textwrap.dedent(RUN))
    runs = {}
    for name, extra, rule in (("installed", [], None), ("hidden", [str(tmp_path / "hide")], None),
                              ("asked", [], "mentored:alpha=0.999999")):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(extra + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep))
        env.pop("ACESPEC_VLLM_RULE", None)
        if rule:
            env["ACESPEC_VLLM_RULE"] = rule  # every sampled request's rule: the power check
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default would take most of the machine
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this one process, where the repair is
        out = tmp_path / f"{name}.json"
        p = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(target), str(draft), str(out)], env=env,
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
        (tmp_path / f"{name}.log").write_text(p.stdout + p.stderr)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    on, off = runs["installed"], runs["hidden"]
    # the first run really had the plugin (both entry points found, the sampler patched), the second none
    assert on["entry_points"] == ["acespec.cloud.vllm_plugin:AceSpecRules", "acespec.cloud.vllm_plugin:register"]
    assert off["entry_points"] == []
    assert on["patched"] is True and off["patched"] is False  # in the driver; vLLM's workers load plugins alike
    assert len(on["outputs"]) == 6 and all(len(o["ids"]) == 24 for o in on["outputs"])
    assert on["outputs"] == off["outputs"]  # token ids and their log-probabilities, greedy and seeded
    # power: the same engine with a rule asked for every sampled request (mentored, alpha near 1: nearly
    # every draft kept) gives other sampled texts, and the greedy ones unchanged
    asked = runs["asked"]["outputs"]
    assert asked[:3] == off["outputs"][:3]
    assert all(a["ids"] != b["ids"] for a, b in zip(asked[3:], off["outputs"][3:]))
