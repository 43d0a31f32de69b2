"""`acespec models export-hf NAME DIR`: a registry GGUF as a Hugging Face model directory.

Serving engines such as vLLM load Hugging Face checkpoints, while the registry ships GGUF files (the
only form of the default pair that installs from the package index). transformers reads GGUF
(dequantizing the weights), so one load and one `save_pretrained` turn the registry's target into a
directory `acespec serve --engine vllm --target DIR` can serve. The dequantized weights are the GGUF's
own values, so the exported model computes what the quantized one does up to the matmul kernels.

The export checks what the pairing depends on: the directory's tokenizer must give the same
vocabulary fingerprint as the GGUF itself, or no GGUF drafter could talk to a cloud serving it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from acespec.models.base import ModelError
from acespec.models.hf import HFTokenizer
from acespec.models.llama import gguf_fingerprint
from acespec.models.registry import resolve

DTYPES = ("bfloat16", "float16", "float32")


def gguf_tokenizer_fingerprint(path: Path) -> str:
    """The fingerprint llama.cpp gives the GGUF's vocabulary (no weights are loaded)."""
    import llama_cpp  # heavy: loads llama.cpp's library

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return gguf_fingerprint(llm)
    finally:
        llm.close()


def hf_tokenizer_fingerprint(model_dir: Path) -> str:
    """The fingerprint of a Hugging Face directory's tokenizer, over the model's whole vocabulary."""
    import transformers  # heavy: the hf extra

    vocab = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    return HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(model_dir)), vocab).fingerprint


def export_hf(spec: str, out_dir: str | Path, *, dtype: str = "bfloat16", weights: bool = True, say=print) -> str:
    """Write model `spec` (a registry name or .gguf path) to `out_dir` as a Hugging Face directory
    (tokenizer, config, safetensors); returns the fingerprint both share. `weights=False` writes the
    tokenizer alone (seconds, for checking a pairing)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    r = resolve(spec, auto_install=True)
    if r.kind != "gguf" or r.path is None:
        raise ModelError(f"{spec!r} is not a GGUF model ({r.kind}); export-hf converts registry names and .gguf files")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ModelError(f"{out} exists and is not empty; give a new directory")
    try:
        import torch  # heavy: the hf extra
        import transformers  # heavy: the hf extra

        if weights:  # transformers needs both to read GGUF weights, and says so only after the tokenizer has loaded
            for extra in ("accelerate", "gguf"):  # looked up, not imported: transformers imports them itself
                if importlib.util.find_spec(extra) is None:
                    raise ImportError(f"no module named {extra!r}", name=extra)
    except ImportError as e:
        raise ModelError(
            f"export-hf needs torch, transformers, gguf and accelerate ({e.name or e} is missing here): run "
            "`bash scripts/setup.sh dev` and export with .venv/bin/acespec (the vLLM profile has no accelerate)"
        ) from e
    src = Path(r.path)
    say(f"export-hf: reading {src.name} with transformers (dequantizing to {dtype})")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = None
        if weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(src.parent), gguf_file=src.name, dtype=getattr(torch, dtype)
            )
    except ImportError as e:  # transformers raises this when the gguf package is missing
        raise ModelError(f"export-hf: {e}") from e
    # write beside the target and rename at the end, so a failure leaves no half-written directory
    tmp = out.with_name(f".{out.name}.partial")

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok.save_pretrained(str(tmp))
        if model is not None:
            # the weights are plain tensors now; transformers still tags the model as GGUF-quantized
            # and refuses to save it unless the tag goes
            # transformers types a model's attributes as Tensor | Module; these two are plain flags
            model.hf_quantizer = None  # type: ignore[assignment]
            model.is_quantized = False  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
        else:  # the tokenizer needs the model's vocabulary size to be fingerprinted
            cfg = transformers.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
            cfg.save_pretrained(str(tmp))
        want, got = gguf_tokenizer_fingerprint(src), hf_tokenizer_fingerprint(tmp)
        if want != got:
            raise ModelError(
                f"export-hf: the exported tokenizer's fingerprint {got} differs from the GGUF's {want}; "
                "drafters of this GGUF could not pair with it"
            )
        if out.exists():
            out.rmdir()  # checked empty above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"export-hf: wrote {out} (tokenizer fingerprint {got}, same as the GGUF's)")
    return got
