"""transformers side of ``bench/peers.py``: the GGUF -> HF conversion, and a ``generate`` worker.

Run with the project's interpreter (torch, transformers, accelerate, gguf); ``bench/peers.py``
starts it as a subprocess so the benchmark driver itself stays free of torch.

``python bench/peers_hf.py convert GGUF OUT_DIR``
    Loads the GGUF with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` (Q4_1
    dequantized to f32), copies the state dict into a fresh ``LlamaForCausalLM(config)`` (a
    GGUF-loaded model refuses ``save_pretrained``), drops the ``quantization_config`` the GGUF
    loader leaves in the config (vLLM would otherwise try to run a GGUF-quantized model), and
    saves it with the tokenizer: a plain f32 safetensors checkpoint. Written to a temporary
    sibling directory, then renamed, so a half-written checkpoint is never taken for a done one.

``python bench/peers_hf.py serve CHECKPOINT --dtype f32|bf16 --threads N``
    A line-oriented "server" over stdin/stdout: loads the checkpoint, prints
    ``{"ready": true}``, then for each request line ``{"prompts": [...], "tokens": N}`` runs one
    greedy batched ``generate`` (left padding, EOS ignored: exactly N new tokens per prompt) and
    answers ``{"first_token_s": ..., "total_s": ..., "tokens": [n, ...]}`` with times measured
    around ``generate`` (the first token time from a streamer's second ``put``: the first ``put``
    is the prompt) and the first sequence's text. EOF ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


def convert(gguf: str, out: str) -> None:
    """Write an f32 HF safetensors checkpoint (and tokenizer) of ``gguf`` to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    directory, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config).to(torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


class _FirstTokenTimer:
    """A ``generate`` streamer that records when the first new tokens arrive."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        """Called with the prompt first, then with each step's new tokens."""
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        """Called once generation finishes."""


def serve(checkpoint: str, dtype: str, threads: int) -> None:
    """Answer generate requests read from stdin, one JSON line each (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out = sys.stdout
    out.write(json.dumps({"ready": True, "torch_threads": torch.get_num_threads(),
                          "torch": torch.__version__}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        n = int(req["tokens"])
        enc = tok(req["prompts"], return_tensors="pt", padding=True)
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.pad_token_id, streamer=timer)
        t1 = time.perf_counter()
        new = gen[:, enc["input_ids"].shape[1]:]
        resp = {"first_token_s": (timer.first or t1) - t0, "total_s": t1 - t0,
                "tokens": [int(new.shape[1])] * int(new.shape[0]),
                "text0": tok.decode(new[0], skip_special_tokens=True)}
        out.write(json.dumps(resp) + "\n")
        out.flush()


def main() -> int:
    """``convert`` or ``serve`` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("gguf")
    c.add_argument("out")
    s = sub.add_parser("serve")
    s.add_argument("checkpoint")
    s.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    s.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.cmd == "convert":
        convert(args.gguf, args.out)
    else:
        serve(args.checkpoint, args.dtype, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
