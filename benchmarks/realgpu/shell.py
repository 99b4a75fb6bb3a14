"""How the real-GPU steps run a program on the node, and the environments they give it."""

from __future__ import annotations

import select
import shutil
import subprocess
import time

HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


def sh(argv: list[str], *, env: dict | None = None, timeout: float = 120, input: bytes | None = None) -> dict:
    """Run ``argv``; its exit status, output and wall milliseconds (never raises)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, env=env, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        rc, out, err = -1, b"", str(exc).encode()
    return {"argv": argv, "rc": rc, "ms": round((time.perf_counter() - start) * 1000, 1),
            "stdout": out.decode(errors="replace")[-20000:], "stderr": err.decode(errors="replace")[-4000:]}



def gpu_program(node, template, seconds: int) -> tuple[list[str], str, subprocess.Popen]:
    """The CUDA program holding GPU 0 for ``seconds`` in a container that our prestart hook gave
    it, under runc's default root (``/run/runc``, which ``ps`` and the exporter's scan read),
    its removal left to the node's undo list: (runc, container name, its ``runc run``). End it
    with :func:`end_container`."""
    runc = [node.runc[0]]
    bundle = node.bundle(template, [node.entries()["hook"]], GPU_ENV, ["/cudatest", str(seconds)])
    name = bundle.name
    node.undo.append(lambda: (sh([*runc, "delete", "-f", name], env=node.runc_env),
                              shutil.rmtree(bundle, ignore_errors=True)))
    proc = subprocess.Popen([*runc, "run", *node.no_pivot, "--bundle", str(bundle), name], env=node.runc_env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return runc, name, proc


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The program's first line of output (it has started), or "no output" within ``timeout``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().decode(errors="replace").strip() if ready else "no output"


def collect(proc: subprocess.Popen, timeout: float = 180) -> dict:
    """A started container's outcome once it ends (killed past ``timeout``), shaped as :func:`sh`'s."""
    try:
        stdout, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, err = proc.communicate()
    return {"argv": proc.args, "rc": proc.returncode, "ms": 0, "stdout": stdout.decode(errors="replace"),
            "stderr": err.decode(errors="replace")[-4000:]}


def end_container(runc: list[str], name: str, proc: subprocess.Popen, env: dict | None) -> None:
    """Kill a container left holding the GPU, reap its ``runc run``, and delete its state."""
    sh([*runc, "kill", name, "KILL"], env=env)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    sh([*runc, "delete", "-f", name], env=env)
