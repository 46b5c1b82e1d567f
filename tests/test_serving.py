"""Serving from threads and from forked processes (docs/serving.md): one model shared by several threads gives the
single thread's outputs; a child forked after the model ran answers (GNU OpenMP's threads would hang it: the control
case shows they do); the stdlib multi-worker server recipe (examples/serve.py), serving the model in PyTorch or its
graph in ONNX Runtime, answers a bounded load test with the single process's answers. The page's serving recipes are
run by tests/test_serving_page.py and tests/test_onnx_runtime_alone.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from tiny_models import tokenizer as tiny_tokenizer

import disentangled
from disentangled.serving import forking

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    position_buckets=8,
    max_relative_positions=64,
    num_labels=2,
)


def classifier() -> disentangled.DisentangledForSequenceClassification:
    torch.manual_seed(0)
    return disentangled.DisentangledForSequenceClassification(disentangled.DisentangledConfig(**TINY, vocab_size=100))


def test_threads_share_one_model():
    """Four threads, 8 calls each, on one model: every output equals the one-thread output of the same batch."""
    model = classifier().eval()
    batches = [torch.randint(1, 100, (3, 5 + 7 * i), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.inference_mode():
        expected = [model(input_ids=ids).logits for ids in batches]
    results, errors = {}, []

    def work(thread: int) -> None:
        try:
            for i, ids in enumerate(batches):
                with torch.inference_mode():
                    results[(thread, i)] = model(input_ids=ids).logits
        except Exception as error:  # noqa: BLE001  (reported by the assertion below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == 32
    for (_, i), logits in results.items():
        torch.testing.assert_close(logits, expected[i], rtol=1e-5, atol=1e-6)


FORK = textwrap.dedent(
    """
    import multiprocessing, sys, torch
    import disentangled
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = disentangled.DisentangledConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=256, vocab_size=100, num_labels=2)
    model = disentangled.DisentangledForSequenceClassification(config).eval()
    ids = torch.randint(1, 100, (8, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits  # the parent runs the model (its OpenMP threads start) before forking

    def child(queue):
        with torch.inference_mode():
            queue.put((torch.get_num_threads(), model(input_ids=ids).logits.tolist()))  # plain values

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    process.join(float(sys.argv[1]))
    if process.is_alive():
        process.kill()
        print("the child hung")
        sys.exit(3)
    threads, logits = queue.get(timeout=10)
    logits = torch.tensor(logits)
    print(f"the child answered on {threads} thread(s), max |diff| {(logits - expected).abs().max().item():.1e}")
    sys.exit(0 if torch.allclose(logits, expected, rtol=1e-5, atol=1e-5) else 1)
    """
)


@pytest.mark.skipif(not forking.uses_openmp() or sys.platform != "linux", reason="GNU OpenMP's fork hang is Linux's")
def test_a_child_forked_after_a_forward_answers():
    """With the package imported, the forked child answers within seconds, on one thread, with the parent's outputs;
    with DISENTANGLED_FORK_THREADS=keep (torch's setting left alone) the same child hangs: the control case."""
    run = [sys.executable, "-c", FORK]
    fixed = subprocess.run([*run, "60"], capture_output=True, text=True, timeout=180)
    print(fixed.stdout, fixed.stderr)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "answered on 1 thread(s)" in fixed.stdout
    assert "runs torch on 1 thread instead of 2" in fixed.stderr and "DISENTANGLED_FORK_THREADS=keep" in fixed.stderr
    env = {**__import__("os").environ, "DISENTANGLED_FORK_THREADS": "keep"}
    control = subprocess.run([*run, "15"], capture_output=True, text=True, timeout=180, env=env)
    print(control.stdout)
    assert control.returncode == 3 and "the child hung" in control.stdout


@pytest.mark.parametrize("served", ["pytorch", "onnx"])
def test_multi_worker_server_load_test(tmp_path, served):
    """examples/serve.py: 2 forked workers behind one socket on loopback, 200 requests from 4 clients; every answer
    is the single process's (same labels, logits within float32 rounding), p50 / p99 printed, and it stops by itself.
    The model in PyTorch, and (`--onnx`) its `--kernel` graph in ONNX Runtime, a session made in each worker."""
    tokenizer = tiny_tokenizer()
    shape = TINY
    if served == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        from disentangled.serving import ort_operator

        if ort_operator.why_unavailable() is not None:
            pytest.skip(f"no operator library: {ort_operator.why_unavailable()}")
        shape = {**TINY, "hidden_size": 128, "num_attention_heads": 2}  # 64 dimensions per head, as the operator takes
    model = disentangled.DisentangledForSequenceClassification(
        disentangled.DisentangledConfig(**shape, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    )
    model.save_pretrained(tmp_path / "classifier")
    tokenizer.save_pretrained(tmp_path / "classifier")
    command = [sys.executable, str(ROOT / "examples" / "serve.py"), str(tmp_path / "classifier")]
    if served == "onnx":
        from disentangled import cli

        graph = tmp_path / "classifier.onnx"
        assert cli.main(["export-onnx", str(tmp_path / "classifier"), str(graph), "--kernel"]) == 0
        command += ["--onnx", str(graph)]
    result = subprocess.run(
        [*command, "--workers", "2", "--load-test", "200", "--clients", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(result.stdout, result.stderr[-2000:])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    runtime = {"pytorch": "PyTorch", "onnx": "ONNX Runtime"}[served]
    assert f"200 of 200 requests answered by 2 forked workers ({runtime})" in result.stdout
    assert " p50 " in result.stdout and " p99 " in result.stdout
    difference = float(result.stdout.split("largest logit difference from the single process ")[1].split()[0])
    assert difference <= 1e-4
