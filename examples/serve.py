"""A multi-worker HTTP server for a text classifier, standard library only: the model loaded and run once in the
parent, then forked workers that share its memory and answer on one listening socket (what gunicorn --preload does).

    python examples/serve.py MODEL_DIR --workers 2 --port 8000                     # the model in PyTorch
    python examples/serve.py MODEL_DIR --onnx model.onnx --workers 2 --port 8000   # its exported graph, ONNX Runtime
    curl -s localhost:8000 -d '{"texts": ["a good film", "a dull one"]}'

    python examples/serve.py MODEL_DIR --workers 2 --load-test 300 --clients 4   # a bounded load test; then it stops

By default the workers run the model in PyTorch, each on one thread: `import disentangled` sets that in every forked
child, where GNU OpenMP's threads would hang (docs/serving.md). With `--onnx GRAPH` they run the graph that
`disentangled export-onnx MODEL_DIR GRAPH` wrote (`--kernel` or not) in ONNX Runtime instead, through the package's
session helper (`onnx_export.session`, which loads the operator's library beside a `--kernel` graph), one thread
each; ONNX Runtime's threads do not survive fork() either, so each worker makes its own session after forking. The
tokenizer and the labels come from MODEL_DIR either way. POST a JSON object {"texts": [...]}; the answer is
{"logits": [[...], ...], "labels": [...]} (the config's id2label). The load test sends real English text (the
docstrings of Python's standard library) from several client threads, checks every answer against the parent's own
outputs for the same texts, and prints the 50th and 99th percentile latency.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.request

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import disentangled  # noqa: F401  (registers the architecture; forked workers run torch on one thread)


class Classifier:
    """The model in PyTorch, or with `onnx` its exported graph in ONNX Runtime (`start` makes the session: again in
    each forked worker)."""

    def __init__(self, model_dir: str, onnx: str | None = None, max_length: int = 256):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.onnx = onnx
        self.model = None if onnx else AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        self.max_length = max_length
        self.start()

    def start(self) -> None:
        if self.onnx:
            from disentangled.serving.onnx_export import session

            self.session = session(self.onnx, threads=1)
            self.inputs = [graph_input.name for graph_input in self.session.get_inputs()]

    def __call__(self, texts: list[str]) -> dict:
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        if self.onnx:  # the inputs the graph has (token_type_ids only where the model has token types)
            (logits,) = self.session.run(["logits"], {name: encoded[name].numpy() for name in self.inputs})
            logits = torch.from_numpy(logits)
        else:
            encoded.pop("token_type_ids", None)
            with torch.inference_mode():
                logits = self.model(**encoded).logits
        labels = [self.config.id2label[int(i)] for i in logits.argmax(-1)]
        return {"logits": logits.tolist(), "labels": labels}


def handler_for(classifier: Classifier):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                texts = request["texts"]
                if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
                    raise ValueError("'texts' must be a non-empty list of strings")
                status, answer = 200, classifier(texts)
            except (ValueError, KeyError, TypeError) as error:
                status, answer = 400, {"error": f"expected a JSON object {{'texts': [...]}}: {error}"}
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002  (quiet: a server log per request is the caller's choice)
            pass

    return Handler


def start_workers(classifier: Classifier, listening: socket.socket, workers: int) -> list[int]:
    """Fork `workers` processes that serve on the listening socket; returns their process ids."""
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker: the model's memory is the parent's, copied only where written
            classifier.start()  # an ONNX Runtime session of its own (the parent's threads are not in this process)
            server = http.server.HTTPServer(listening.getsockname(), handler_for(classifier), bind_and_activate=False)
            server.socket = listening
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            try:
                server.serve_forever()
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


def stop_workers(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:
        os.waitpid(pid, 0)


def post(url: str, texts: list[str], timeout: float = 60.0) -> dict:
    request = urllib.request.Request(url, json.dumps({"texts": texts}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def load_test(url: str, classifier: Classifier, requests: int, clients: int, seed: int = 0) -> dict:
    """`requests` POSTs of 1 to 4 real texts each from `clients` threads; every answer is compared with the parent's
    own outputs for those texts. Returns latency percentiles (ms), the largest logit difference and failures."""
    from disentangled.demo.data import python_docs_documents

    documents = [" ".join(d["text"].split()[:64]) for d in python_docs_documents()[:400]]
    rng = random.Random(seed)
    jobs = [rng.sample(documents, rng.randint(1, 4)) for _ in range(requests)]
    expected = [classifier(texts) for texts in jobs]  # the single process's answers
    latencies, differences, failures = [], [], []
    lock = threading.Lock()

    def client(index: int) -> None:
        for job in range(index, requests, clients):
            start = time.perf_counter()
            try:
                answer = post(url, jobs[job])
            except OSError as error:
                with lock:
                    failures.append(f"request {job}: {error}")
                continue
            elapsed = time.perf_counter() - start
            logits, reference = torch.tensor(answer["logits"]), torch.tensor(expected[job]["logits"])
            with lock:
                latencies.append(elapsed * 1000)
                differences.append((logits - reference).abs().max().item())
                if answer["labels"] != expected[job]["labels"]:
                    failures.append(f"request {job}: labels {answer['labels']} != {expected[job]['labels']}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {
        "answered": len(latencies),
        "requests": requests,
        "seconds": time.perf_counter() - started,
        "p50_ms": quantiles[49],
        "p99_ms": quantiles[98],
        "max_logit_difference": max(differences, default=float("nan")),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a sequence classifier folder with its tokenizer")
    parser.add_argument(
        "--onnx",
        metavar="GRAPH",
        default=None,
        help="serve this graph of MODEL_DIR (disentangled export-onnx, --kernel or not) in ONNX Runtime, not PyTorch",
    )
    parser.add_argument("--workers", type=int, default=2, help="forked worker processes (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one; default 8000)")
    parser.add_argument("--load-test", type=int, default=0, metavar="N", help="send N requests, report, and stop")
    parser.add_argument("--clients", type=int, default=4, help="load test: client threads (default 4)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.clients < 1:
        raise SystemExit("--workers and --clients must be at least 1")
    classifier = Classifier(args.model_dir, args.onnx)
    classifier(["warm-up: the model runs once in the parent, as a preloading server's does"])
    listening = socket.create_server((args.host, 0 if args.load_test else args.port), backlog=64)
    pids = start_workers(classifier, listening, args.workers)
    url = "http://{}:{}/".format(*listening.getsockname()[:2])
    try:
        if not args.load_test:
            served = f"{args.onnx} in ONNX Runtime" if args.onnx else f"{args.model_dir} in PyTorch"
            print(f"serving {served} on {url} with {args.workers} workers (Ctrl-C stops)", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return 0
        result = load_test(url, classifier, args.load_test, args.clients)
    finally:
        stop_workers(pids)
        listening.close()
    print(
        f"{result['answered']} of {result['requests']} requests answered by {args.workers} forked workers "
        f"({'ONNX Runtime' if args.onnx else 'PyTorch'}) in "
        f"{result['seconds']:.1f} s from {args.clients} clients: p50 {result['p50_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms; largest logit difference from the single process "
        f"{result['max_logit_difference']:.1e}"
    )
    for failure in result["failures"][:5]:
        print(failure)
    return 0 if not result["failures"] and result["answered"] == result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
