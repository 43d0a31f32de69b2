"""`acespec eval --engine vllm`: the length-inflation harness through vLLM's own speculative decoding
(`draft_model`), with AceSpec's rules applied by its plugin (acespec/eval/vllm_runner.py).

Runs in the vLLM profile, as tests/test_vllm.py. The models are tiny random Qwen2s that go with a real
tokenizer (a byte-level BPE trained here on a few sentences, with a chat template), so the harness
builds, scores and reports its prompts as it does for real models; one vLLM engine is started, in the
one test that runs jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

if os.environ.get("ACESPEC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup.sh vllm makes .venv-vllm)")
pytest.importorskip("transformers")

from acespec.models.synthetic import save_random_qwen2  # noqa: E402

pytestmark = pytest.mark.vllm

CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer():
    """A byte-level BPE with Qwen's special tokens and a chat template, trained in a blink on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from acespec.eval.mathgen import make_problems

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([p.prompt for p in make_problems(20, 0)] * 3, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>")
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, drafter dir): the same random weights twice, each with the tokenizer. Unscaled, the
    random model's rows are close to uniform, and a drafter equal to the target has rows equal to the
    target's (same temperature, no top-k / top-p): with its real rows strict keeps every draft (p / q = 1),
    where one-hot rows would keep a draft only with probability p(x), a fraction of a percent here; and
    the support filter (min_p 0.1) refuses every draft."""
    root = tmp_path_factory.mktemp("eval-vllm")
    tok = _tokenizer()
    target = save_random_qwen2(root / "target", seed=0, head_scale=1.0, vocab_size=len(tok))
    tok.save_pretrained(str(target))
    draft = root / "draft"
    shutil.copytree(target, draft)
    return target, draft


def _eval(*args, timeout=600):
    exe = os.path.join(os.path.dirname(sys.executable), "acespec")
    return subprocess.run([exe, "eval", "--quiet", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


def test_eval_on_vllm_writes_records_and_report_and_resumes(pair, tmp_path):
    """math, 2 prompts, 16 tokens, strict and cactus under the support filter, K = 3, on one vLLM engine:
    every job's record is written with the harness's fields, its counts consistent (accepted <= drafted,
    length <= rounds (K + 1)); strict kept every draft (the plugin saw the drafter's real rows, not
    one-hot ones) and the support filter none; the report is printed; a resume finds every job done and
    starts no engine."""
    target, draft = pair
    out = tmp_path / "run"
    k, T = 3, 16
    r = _eval("--engine", "vllm", "--target", target, "--draft", draft, "--rules", "strict,cactus:delta=0.35+support",
              "--dataset", "math", "--n", 2, "--max-tokens", T, "--k", k, "--n-ctx", 512, "--concurrency", 4, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(out)
    assert sorted(x["arm"] for x in recs) == ["cactus:delta=0.35+support"] * 2 + ["strict"] * 2
    for x in recs:
        assert x["engine"] == "vllm" and x["concurrency"] == 4 and x["acc_p"] == [] and x["acc_rank"] == []
        assert 1 <= x["length"] <= T and x["rule_used"] == x["arm"] and x["prompt_tokens"] > 10
        assert 0 <= x["accepted"] <= x["drafted"] and 1 <= x["rounds"] and x["length"] <= x["rounds"] * (k + 1)
        assert x["length"] == T or x["finished_eos"]
        assert 0 < x["ttft_s"] <= x["wall_s"] and isinstance(x["text"], str) and x["correct"] is not None
    strict = [x for x in recs if x["arm"] == "strict"]
    # every draft kept but those a last block cut off at the budget (the plugin saw the drafter's real rows)
    assert all(0 <= x["drafted"] - x["accepted"] <= k and x["accepted"] >= T // 2 for x in strict), strict
    assert all(x["rounds"] < x["length"] for x in strict)  # speculation happened: fewer passes than tokens
    # the support filter refused every draft (p(x) < 0.1 everywhere): one token per pass, from its support
    assert all(x["accepted"] == 0 < x["drafted"] and x["rounds"] == x["length"] for x in recs if x["arm"] != "strict")
    assert "strict" in r.stdout and "cactus:delta=0.35+support" in r.stdout
    assert "n/a for runs on `--engine vllm`" in (out / "report.md").read_text()
    # a resume with nothing left to do replays the records, rewrites the report and starts no vLLM
    again = _eval("--resume", out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_records(out)) == 4 and "Initializing a V1 LLM engine" not in again.stderr
    assert (out / "report.md").is_file()
    rep = _eval("--report-only", out)
    assert rep.returncode == 0, rep.stderr[-3000:]


def test_eval_on_vllm_refuses_what_it_cannot_do(pair, tmp_path, capsys):
    """Bad combinations are refused with the reason, before any engine starts (in process)."""
    from acespec.cli import main

    target, draft = pair
    bare = save_random_qwen2(tmp_path / "bare", seed=0)  # weights without a tokenizer, and another vocabulary
    for args, why in (
        (["--engine", "vllm", "--target", target, "--draft", draft, "--parallel", 2], "--parallel and --batching are the llama.cpp harness's"),
        (["--engine", "vllm", "--target", target, "--draft", draft, "--batching", "exact"], "--parallel and --batching"),
        (["--engine", "vllm", "--target", target], "needs --target DIR and --draft DIR"),
        (["--concurrency", 4], "--concurrency is --engine vllm's"),
        (["--engine", "vllm", "--target", bare, "--draft", draft], "has no tokenizer"),
        (["--engine", "vllm", "--target", target, "--draft", bare], "vocabulary"),
        (["--engine", "vllm", "--target", tmp_path / "nowhere", "--draft", draft], "not a Hugging Face model directory"),
    ):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        assert main(["eval", "--quiet", "--n", "1", *map(str, args), "--out", str(out)]) != 0
        assert why in capsys.readouterr().err, args
