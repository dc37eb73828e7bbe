"""Starts several `transformers serve` processes for tests/test_clients_transformers_serve.py, paying
for the import once: this process imports transformers' CLI (most of a server's start-up on a
small CPU: ~12 s of a ~30 s start on 2 loaded cores), then forks one child per port, each
running `transformers serve MODEL --port P` as the CLI would. Each child is a separate process
(its own pid, socket and model), so one can be killed with SIGKILL while the others serve on.

Usage: python tests/transformers_serve_pair.py MODEL_DIR LOG_DIR PORT [PORT ...]
Prints one line `<port> <pid>` per child (whose output goes to LOG_DIR/serve-PORT.log), then
waits; SIGTERM ends the children with it.
Nothing has started a thread before the fork (imports only), so forking is safe.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys

PREIMPORTS = (
    "transformers.integrations.hub_kernels",
    "transformers.conversion_mapping",
    "transformers.modeling_layers",
    "transformers.image_processing_utils",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.cli.serving.chat_completion",
    "transformers.cli.serving.completion",
    "transformers.cli.serving.response",
    "transformers.cli.serving.systemone",
    "transformers.cli.serving.transcription",
    "transformers.cli.serving.model_manager",
    "transformers.cli.serving.server",
    "uvicorn",
    "fastapi",
)


def main() -> None:
    folder, logs, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
    from transformers.cli.transformers import main as cli

    # what each server would import after parsing its arguments (measured with -X importtime:
    # ~14 s of a child's start on 2 loaded cores), imported once here instead
    for name in PREIMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    children: list[int] = []
    for port in ports:
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own group: the parent's signals are not its signals
            log = os.open(os.path.join(logs, f"serve-{port}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.argv = ["transformers", "serve", folder, "--host", "127.0.0.1", "--port", port]
            sys.argv += ["--device", "cpu", "--log-level", "warning"]
            try:
                sys.exit(cli())
            finally:
                os._exit(1)
        children.append(pid)
        print(port, pid, flush=True)

    def stop(*_: object) -> None:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            try:
                os.waitpid(child, 0)
            except ChildProcessError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in children:
        try:
            os.wait()
        except ChildProcessError:
            break
    stop()


if __name__ == "__main__":
    main()
