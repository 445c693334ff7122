"""The load test's servers and what it reads from them: `specbatch serve` (or vLLM's OpenAI server, the
peer) as a subprocess on a loopback port (its log in a file, stopped with SIGTERM), its memory and CPU
time from /proc, and our engine's step counters from /metrics (or from an engine in this process)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError

from .loadtest_report import parse_step_model, step_model_counters, step_model_use

LOOPBACK = "127.0.0.1"


class LoadtestError(SpecbatchError):
    """Options or a server the load test cannot use."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@dataclass
class ServerProcess:
    """`specbatch serve` in a subprocess on a loopback port; its log goes to `log_path`."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-c", "from specbatch.cli import app; app()", "serve", "--host", LOOPBACK,
                "--port", str(self.port), *self.args]

    def start(self, timeout_s: float) -> None:
        import httpx

        self._log = open(self.log_path, "ab")  # noqa: SIM115 - a server log, appended while it runs
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LoadtestError(f"the server exited with code {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise LoadtestError(f"the server did not answer /health within {timeout_s:.0f} s; see {self.log_path}")

    def rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), None)
        return int(line.split()[1]) / 1024 if line else None

    def cpu_s(self) -> float | None:
        """User + system CPU seconds the server process has used (all its threads)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


@dataclass
class VllmServerProcess(ServerProcess):
    """vLLM's OpenAI-compatible server (bench/vllm/run.sh: its own venv and environment) on the pair:
    float32 and eager like bench/vllm/compare.py; `args` are extra vLLM flags (--speculative-config JSON)."""

    target_dir: str = ""
    max_num_seqs: int = 32

    def command(self) -> list[str]:
        from specbatch.bench.vllm.compare import RUN_SH

        return ["bash", str(RUN_SH), "-m", "vllm.entrypoints.openai.api_server", "--model", self.target_dir,
                "--host", LOOPBACK, "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", "1024", "--seed", "0", *self.args]


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def engine_counters(snapshot: dict) -> dict:
    return {"steps": snapshot["steps_total"], "step_s": snapshot["step_seconds_sum"],
            "by_strategy": {name: dict(mix) for name, mix in snapshot["by_strategy"].items()},
            "step_model": step_model_counters(snapshot["fidelity"])}


_MIX_SERIES = {"specbatch_strategy_steps_total": "steps", "specbatch_strategy_step_seconds_total": "seconds",
               "specbatch_strategy_tokens_total": "tokens", "specbatch_strategy_rows_total": "rows"}


def scrape_counters(url: str) -> dict | None:
    """Our engine's step counters from a server's /metrics; None for a server without them (vLLM)."""
    import httpx

    return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)


def parse_counters(text: str) -> dict | None:
    """The counters scrape_counters reads, from a /metrics page's text (serve.metrics.render_metrics)."""
    if "specbatch_steps_total" not in text:
        return None
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    by_strategy: dict[str, dict[str, float]] = {}
    for series, value in samples.items():
        name, _, labels = series.partition('{strategy="')
        if name in _MIX_SERIES:
            label = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), labels[:-2])
            by_strategy.setdefault(label, {})[_MIX_SERIES[name]] = float(value)
    return {"steps": float(samples["specbatch_steps_total"]), "step_s": float(samples["specbatch_step_seconds_sum"]),
            "by_strategy": by_strategy, "step_model": parse_step_model(samples)}


def strategy_mix(before: dict, after: dict) -> dict:
    """What a run's steps ran, by strategy: share of the steps, mean step time, tokens per step (all rows),
    mean batch size; from two counter readings."""
    steps_total = after["steps"] - before["steps"]
    mix = {}
    for label, counts in after["by_strategy"].items():
        prior = before["by_strategy"].get(label, {})
        steps = counts["steps"] - prior.get("steps", 0)
        if steps <= 0:
            continue
        mix[label] = {"share": steps / steps_total,
                      "step_ms": 1000 * (counts["seconds"] - prior.get("seconds", 0.0)) / steps,
                      "tokens_per_step": (counts["tokens"] - prior.get("tokens", 0)) / steps,
                      "mean_batch_size": (counts["rows"] - prior.get("rows", 0)) / steps}
    return dict(sorted(mix.items(), key=lambda item: -item[1]["share"]))


def engine_use(before: dict | None, after: dict | None, run: dict) -> dict:
    """How the engine spent the run: mean step time, the share of the run's span spent in steps
    (below 1 at saturation: time lost between steps, to prefill, or to the HTTP side holding the GIL),
    and the strategies its steps ran."""
    if before is None or after is None:
        return {"engine_steps": None, "engine_step_ms_mean": None, "engine_busy_fraction": None, "strategy_mix": None,
                "step_model": None}
    steps, step_s = after["steps"] - before["steps"], after["step_s"] - before["step_s"]
    return {"engine_steps": steps, "engine_step_ms_mean": 1000 * step_s / steps if steps else None,
            "engine_busy_fraction": step_s / run["span_s"] if run["span_s"] else None,
            "strategy_mix": strategy_mix(before, after) if steps else {},
            "step_model": step_model_use(before.get("step_model"), after.get("step_model"))}


def machine_note() -> dict:
    return {"loadavg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count()}
