"""Run benchmark commands side by side, one per GPU, each within its own time limit.

    python benchmarks/on_gpus.py --gpus 2 --limit 280 --out DIR \\
        "run.py speed --networks vgg16 --tag _vgg16" "run.py densenet --depths --tag _deep" ...

Commands wait in a queue; each starts on the first free GPU (CUDA_VISIBLE_DEVICES), from the
benchmarks folder; run.py commands without an --out of their own get `--out DIR`. A command still running at its limit is stopped (its
record keeps what it measured: run.py writes after every measurement). Everything a command
prints goes to DIR/gpuK.log under a header, and its exit status after it. The records of
BENCHMARKS.md made two at a time on a two-GPU host were made this way, by hand.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# never NVLink multicast on a shared host (it can take the host's GPUs down for everyone)
SAFE_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


def run_all(commands: list, gpus: int, limit: float, out: str, poll: float = 0.5) -> list:
    """Exit status per command, in the order given (None: stopped at its limit)."""
    os.makedirs(out, exist_ok=True)
    queue = list(enumerate(commands))
    running = {}                      # gpu -> (index, process, started, log)
    status = [None] * len(commands)
    environment = {**os.environ, **SAFE_ENVIRONMENT,
                   "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                                  os.environ.get("PYTHONPATH", "")])}
    while queue or running:
        for gpu in [g for g in range(gpus) if g not in running]:
            if not queue:
                break
            index, command = queue.pop(0)
            log = open(os.path.join(out, f"gpu{gpu}.log"), "a")
            log.write(f"\n=== {command}\n")
            log.flush()
            argv = shlex.split(command)
            if argv[0] == "run.py" and "--out" not in argv:
                argv += ["--out", out]
            process = subprocess.Popen(
                [sys.executable, *argv], cwd=HERE, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**environment, "CUDA_VISIBLE_DEVICES": str(gpu)})
            running[gpu] = (index, process, time.time(), log)
        time.sleep(poll)
        for gpu, (index, process, started, log) in list(running.items()):
            if process.poll() is None and time.time() - started < limit:
                continue
            if process.poll() is None:                   # its limit: stop it and its children
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:       # stuck in a CUDA call, say
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                log.write(f"=== stopped after {limit:.0f} s\n")
            else:
                status[index] = process.returncode
                log.write(f"=== exit {process.returncode} after {time.time() - started:.0f} s\n")
            log.close()
            del running[gpu]
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commands", nargs="+", help="benchmark scripts with their arguments")
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--limit", type=float, default=580, help="seconds per command")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    if args.gpus is None:
        import torch
        args.gpus = torch.cuda.device_count()
    if args.gpus < 1:
        raise SystemExit("on_gpus.py needs a GPU (or --gpus N for N slots)")
    status = run_all(args.commands, args.gpus, args.limit, args.out)
    for command, code in zip(args.commands, status):
        print(f"{'stopped' if code is None else f'exit {code}'}: {command}")
    return 0 if all(code == 0 for code in status) else 1


if __name__ == "__main__":
    sys.exit(main())
