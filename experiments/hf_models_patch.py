"""kernels.patch on Hugging Face transformers' own model code: tiny random llama-family models (two layers, hidden 64),
their logits and a loss's grads with and without the patch, and which blocks the patch fused or declined. What a user
meets when they drop the library into a real model: HF's RMSNorm classes, `act_fn` children, Gemma's (1 + weight)
norm and GELU MLP (both must be declined), Qwen3's per-head q/k norms, Phi-3's fused gate_up projection, Mixtral's
experts. Logits in eval mode without grad (a first and a warm call), then a loss's grads in train mode: each mode
gets its own first-call check, so `blocks` counts each block twice when both pass.

    pip install transformers                                    # not a dependency of kernels
    TRITON_INTERPRET=1 python -m experiments.hf_models_patch     # CPU: the fused kernels through Triton's interpreter
    python -m experiments.hf_models_patch --device cuda --dtype bf16

Norm weights are drawn from N(0, 0.5) so that a (1 + weight) norm and a weight norm differ. Errors are max |patched -
eager| / max |eager|. Not a test: evidence for the closing note.
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

import kernels

try:
    import transformers
except ImportError:             # optional: this experiment only
    transformers = None

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# name: (config class, model class, config overrides)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _rel(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30))


def build(name: str, dtype, device: str):
    config_name, model_name, overrides = MODELS[name]
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.5)
    return model


def compare(name: str, dtype, device: str) -> dict:
    model = build(name, dtype, device)
    patched = kernels.patch(copy.deepcopy(model))
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), device=device)
    before = kernels.stats()
    model.eval(), patched.eval()            # as from_pretrained returns a model: inference checks its own verdicts
    with torch.no_grad():
        reference, first, warm = model(ids).logits, patched(ids).logits, patched(ids).logits
    model.train(), patched.train()
    losses = []
    for m in (model, patched):
        loss = m(ids).logits.float().square().mean()
        loss.backward()
        losses.append(loss.item())
    grad_err = max(_rel(p.grad, q.grad) for p, q in zip(patched.parameters(), model.parameters()) if q.grad is not None)
    after = kernels.stats()
    moved = {k: v - before.get(k, 0) for k, v in after.items()
             if k.startswith("fused") and isinstance(v, int) and v != before.get(k, 0)}
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "first_err": _rel(first, reference),
            "warm_err": _rel(warm, reference), "loss_diff": abs(losses[0] - losses[1]), "grad_err": grad_err,
            "blocks": moved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="append one line per model here")
    args = ap.parse_args(argv)
    if transformers is None:
        ap.error("needs Hugging Face transformers (pip install transformers)")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; one of {', '.join(MODELS)}")
    print(f"transformers {transformers.__version__}, {args.device}, {args.dtype}")
    for name in names:
        row = compare(name, DTYPES[args.dtype], args.device)
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
