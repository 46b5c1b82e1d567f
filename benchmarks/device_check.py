"""Our backends on an accelerator, in one prepared run: parity first, then the benchmark in bfloat16.

    python -m benchmarks.device_check --device cuda            # parity, then benchmarks.run in bfloat16
    python -m benchmarks.device_check --device cpu --no-benchmark

Parity: a 2-layer DeBERTa-v3-shaped model (small hidden size, 16 log buckets so a 300-token batch reaches
them) with spread-out weights, on a padded batch; sdpa and flex_attention against eager on the same device,
float32: outputs within 1e-5 and every gradient within 1e-4 of its scale (flex gradients where PyTorch has a
flex backward, i.e. not on the CPU). Prints one line per backend and exits non-zero on a mismatch. The
CI suite runs on the CPU; this is what a session lent a GPU runs.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import disentangled

CONFIG = dict(
    vocab_size=1000,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    position_buckets=16,
    max_relative_positions=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def spread_weights(model: torch.nn.Module) -> None:
    """N(0, 1/fan_in) matrices, N(0, 1) embeddings, LayerNorm weights near 1 and small biases: attention far
    from uniform, so that a wrong term shows."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() < 2:
                param.copy_((1.0 if name.endswith("LayerNorm.weight") else 0.0) + 0.1 * noise)
            else:
                param.copy_(noise if "embeddings" in name else noise / param.shape[1] ** 0.5)


def run_backend(model, batch, backward: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        output = model(**batch).last_hidden_state
    if backward:
        weights = torch.linspace(-1, 1, output.numel(), device=output.device).view_as(output)
        (output * weights * batch["attention_mask"][..., None]).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.detach(), grads


def parity(device: torch.device) -> bool:
    torch.manual_seed(0)
    reference = disentangled.DisentangledModel(disentangled.DisentangledConfig(**CONFIG))
    spread_weights(reference)
    reference.to(device).set_attn_implementation("eager")
    generator = torch.Generator().manual_seed(1)
    lengths = [300, 171]
    input_ids = torch.randint(1, CONFIG["vocab_size"], (len(lengths), max(lengths)), generator=generator)
    attention_mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    expected, expected_grads = run_backend(reference, batch, backward=True)
    real = batch["attention_mask"].bool()
    scale = max(1.0, expected[real].abs().max().item())
    ok = True
    for backend in ("sdpa", "flex_attention"):
        model = copy.deepcopy(reference)
        model.set_attn_implementation(backend)
        backward = not (backend == "flex_attention" and device.type == "cpu")  # no CPU flex backward
        actual, grads = run_backend(model, batch, backward)
        output_error = (actual - expected)[real].abs().max().item() / scale
        grad_error = float("nan")
        if backward:
            grad_error = max(
                ((grads[name] - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
                for name, want in expected_grads.items()
            )
        passed = output_error <= 1e-5 and (not backward or grad_error <= 1e-4)
        ok &= passed
        print(
            f"{backend:>15} on {device}: outputs {output_error:.1e} (bound 1e-5), gradients {grad_error:.1e} "
            f"(bound 1e-4){'' if backward else ' not checked: no CPU flex backward'}: {'ok' if passed else 'FAIL'}"
        )
    return ok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-benchmark", action="store_true")
    parser.add_argument("--benchmark-args", nargs=argparse.REMAINDER, default=[], help="passed to benchmarks.run")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    ok = parity(device)
    if ok and not args.no_benchmark:
        from benchmarks import run

        run.main(["--device", args.device, "--dtype", "bfloat16", "--no-eager", "--flex", *args.benchmark_args])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
