#!/usr/bin/env python3
"""Capture FreeScale's observable behaviour from a source tree, so two trees can be diffed
(compare.sh DIR_A DIR_B).

    PYTHONPATH=TREE TREE/.venv/bin/python capture.py --tree TREE --out DIR \
        [--export-to MODEL_DIR] [--model MODEL_DIR] [--parts help,data,losses,export] [--reuse-data DIR]

Everything the tree runs, runs in a child process with PYTHONPATH=TREE, cwd=TREE and this
interpreter, through the project's public entry points (``python -m freescale.jobs.cli ...``,
``python -m jobs.<module> --help``, ``mlflow.pyfunc.load_model``). Scratch work (Spark outputs,
checkpoints, the MLflow store and its artifacts, the job logs) goes to DIR/work, never into the
tree. Written under DIR:

  help/<name>.txt          byte-exact stdout of every --help (COLUMNS=100); help/_status.json: exit
                           codes and stderr of each
  data/*.json              the synthetic prepare and the balance: content digests of their outputs
                           (rows, not file bytes: Spark's Parquet bytes vary from run to run), the
                           manifest without its volatile keys, the jobs' MLflow runs and last lines
  losses/<case>.json       4 short 2-rank gloo trainings (`freescale train`, torchrun): hstu|sasrec x
                           plain|prioritized: per-step loss, per-step per-rank cost/samples/loss_sum/
                           targets, deterministic summary metrics (loss, eval metrics), comm path and
                           issue order, the MLflow run (params, tags, step/loss history), masked stdout
  export/fresh_<enc>.json  `freescale export` of the hstu|sasrec prioritized checkpoints: the folder's
                           metadata and per-tensor digests, the MLflow MLmodel, and top-10 predictions
                           of the MLflow model loaded back with mlflow.pyfunc.load_model
  export/top10.json        with --model PATH: predictions of that (old) MLflow model, loaded by this tree
  meta.json                tree, git HEAD, interpreter, timings of each part (not compared)

--export-to PATH copies the MLflow model of the fresh hstu export to PATH (only when capturing the
baseline: refused if PATH exists). Numbers are written as Python's repr (bit-exact). Values that
depend on the clock (step times, bubbles, fractions, job seconds) are recorded by name only; so are
MLflow run/model ids, the git commit and the tree's path (masked as <ID>, <TREE>, <WORK>).

A step that fails (a training, an export, loading --model) is recorded in its part's file as
{"error": ..., "error_output": [last lines]} and the capture goes on; the exit status is then 1.
--reuse-data CAPTURE_DIR trains on that capture's work/prepared and work/shards (to tell a change in
the data jobs from one in the trainer); data/jobs.json then has no job records.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = "100"
STEPS = 8
WORLD = 2
LOCAL_BATCH = 8
SYNTHETIC_USERS = 300
SYNTHETIC_ITEMS = 500
EXPERIMENT = "capture"

# The baseline's (a90fdcd) lists: always captured, so a name that vanishes after a refactor shows
# up as a failed --help instead of a silently missing file. Whatever the tree adds is captured too.
BASE_SUBCOMMANDS = ("prepare", "balance", "train", "calibrate", "compare", "pipeline", "simulate", "export", "demo")
BASE_MODULES = ("balance", "calibrate", "compare", "export", "prepare", "simulate", "train", "workflow")

COMMON_TRAIN = ["--model.embedding_dim", "32", "--loss.num_negatives", "32", "--training.eval_max_samples", "64",
                "--training.threads", "1", "--training.log_every", "1", "--training.seed", "0",
                "--evaluation.sampled_negatives", "20", "--evaluation.unseen_ranking", "true"]
ENCODER_ARGS = {
    "hstu": ["--model.encoder", "hstu", "--model.hstu.num_layers", "1", "--model.hstu.num_heads", "2",
             "--model.hstu.attention_dim", "16", "--model.hstu.linear_dim", "16"],
    "sasrec": ["--model.encoder", "sasrec", "--model.sasrec.num_layers", "1", "--model.sasrec.num_heads", "2",
               "--model.sasrec.max_seq_len", "64"],
}
COMM_MODES = ("plain", "prioritized")
CASES = [(enc, mode) for enc in ENCODER_ARGS for mode in COMM_MODES]
EXPORTED = {"hstu": "hstu_prioritized", "sasrec": "sasrec_prioritized"}  # encoder -> the case exported

# Per-step timing fields: values depend on the clock. What each step carried is deterministic.
STEP_FIELDS = ("cost", "samples", "loss_sum", "targets")
# Metrics whose value is deterministic; any other is recorded by name only when it looks like a time.
DETERMINISTIC_METRIC = re.compile(
    r"^(loss|imbalance|measured_steps|eval_samples|predicted_bubble|step/loss|mrr|(hr|ndcg)_at_\d+|"
    r"(valid|popular|sampled|unseen|best)_.*)$")
CLOCK_METRIC = re.compile(r"(_s$|_s\.|seconds|time|fraction|per_s|^step/)")
VOLATILE_TAGS = {"mlflow.user", "mlflow.source.git.commit", "freescale.code_version", "mlflow.log-model.history",
                 "mlflow.source.git.repoURL", "mlflow.source.git.branch"}
VOLATILE_MANIFEST = {"created_unix_s", "content_sha256"}
MLMODEL_VOLATILE = {"utc_time_created", "model_uuid", "run_id", "model_id", "artifact_path", "model_size_bytes"}

PREDICT_CODE = r'''
import json, random, sys
from pathlib import Path
import mlflow
import pandas as pd

path, out = sys.argv[1], sys.argv[2]
import freescale  # a checkout runs no .pth hook: an older model's old names resolve once the project is imported
model = mlflow.pyfunc.load_model(path)
vocab_file = sorted(Path(path).rglob("item_vocab.json"))[0]
raw = [r for r in json.loads(vocab_file.read_text())["raw_items"][1:] if r is not None]
rng = random.Random(20250101)
lengths = [1, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 64, 80, 100, 150]
histories = [[rng.choice(raw) for _ in range(n)] for n in lengths]
timestamps, ratings = [], []
for h in histories:
    t, ts = 1_700_000_000, []
    for _ in h:
        t += rng.randint(1, 200_000)
        ts.append(t)
    timestamps.append(ts)
    ratings.append([rng.randint(1, 5) for _ in h])

def rows(frame):
    frame = frame.reset_index(drop=True)
    found = []
    for record in frame.to_dict("records"):
        found.append({"items": [str(i) for i in record["items"]],
                      "scores": [float(s) for s in record["scores"]],
                      "unknown_items": int(record["unknown_items"])})
    return found

result = {"vocabulary_size": len(raw), "histories": histories, "queries": {}}
q = result["queries"]
def answer(query):
    # A query MLflow's schema check refuses is recorded as that refusal's first line (the same in both
    # trees when the model's signature is): one refused query does not lose the others.
    try:
        return rows(query())
    except Exception as exc:  # noqa: BLE001
        return {"refused": type(exc).__name__ + ": " + str(exc).split(" with schema ")[0][:80]}

q["lists_default"] = answer(lambda: model.predict(histories))
q["frame_items_default"] = answer(lambda: model.predict(pd.DataFrame({"items": histories})))
q["frame_items_k10_keep_history"] = answer(lambda: model.predict(pd.DataFrame({"items": histories}),
                                                   params={"k": 10, "exclude_history": False}))
q["frame_full_k10"] = answer(lambda: model.predict(pd.DataFrame({"items": histories, "timestamps": timestamps,
                                                       "ratings": ratings}), params={"k": 10}))
odd = [histories[5] + ["no-such-item"], ["no-such-item"], [int(x) if str(x).isdigit() else x for x in histories[9]]]
q["frame_odd_k5"] = answer(lambda: model.predict(pd.DataFrame({"items": odd}), params={"k": 5}))
import os
tree = os.path.realpath(os.environ["PYTHONPATH"].split(os.pathsep)[0])
project = ("freescale",)
result["project_modules_outside_tree"] = sorted(
    name for name, module in list(sys.modules.items())
    if name.split(".")[0] in project and getattr(module, "__file__", None)
    and not os.path.realpath(module.__file__).startswith(tree + os.sep))
Path(out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
'''

MLFLOW_DUMP_CODE = r'''
import json, sys
from mlflow.tracking import MlflowClient
uri, experiment, out = sys.argv[1], sys.argv[2], sys.argv[3]
client = MlflowClient(uri)
exp = client.get_experiment_by_name(experiment)
runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000)
dumped = []
def artifacts(run_id, path=None):
    names = []
    for info in client.list_artifacts(run_id, path):
        names += artifacts(run_id, info.path) if info.is_dir else [info.path]
    return names
for run in runs:
    histories = {}
    for key in run.data.metrics:
        histories[key] = [[m.step, m.value] for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                             key=lambda m: (m.step, m.timestamp))]
    inputs = []
    for d in (run.inputs.dataset_inputs if run.inputs else []):
        inputs.append({"name": d.dataset.name, "source_type": d.dataset.source_type, "source": d.dataset.source,
                       "profile": d.dataset.profile, "digest": d.dataset.digest,
                       "tags": {t.key: t.value for t in d.tags}})
    dumped.append({"run_id": run.info.run_id, "run_name": run.info.run_name, "status": run.info.status,
                   "parent": run.data.tags.get("mlflow.parentRunId"), "params": dict(run.data.params),
                   "tags": dict(run.data.tags), "metrics": histories, "artifacts": artifacts(run.info.run_id),
                   "inputs": inputs})
open(out, "w").write(json.dumps(dumped))
'''

DOWNLOAD_CODE = r'''
import sys
import mlflow
uri, model_uri, dst = sys.argv[1], sys.argv[2], sys.argv[3]
mlflow.set_tracking_uri(uri)
print(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=dst))
'''

SETUP_CODE = r'''
import sys
from mlflow.tracking import MlflowClient
MlflowClient(sys.argv[1]).create_experiment(sys.argv[2], artifact_location=sys.argv[3])
'''

TENSORS_CODE = r'''
import hashlib, json, sys
import torch
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
print(json.dumps({k: {"dtype": str(v.dtype), "shape": list(v.shape),
                      "sha256": hashlib.sha256(v.detach().contiguous().cpu().numpy().tobytes()).hexdigest()}
                  for k, v in sorted(state.items())}))
'''


class CaptureError(Exception):
    """A step of the tree failed: recorded in that part's file, the capture goes on."""


class Capture:
    def __init__(self, tree: Path, out: Path, python: str):
        self.tree, self.out, self.python = tree, out, python
        self.work = out / "work"
        self.env = self._env()
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        self.errors: list[str] = []

    # ------------------------------------------------------------------ plumbing

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FREESCALE_", "MLFLOW_", "SPARK_", "PYSPARK_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                             "PYTHONPATH", "PYTHONHOME", "COLUMNS", "LINES", "TORCHELASTIC_RUN_ID")}
        env.update({
            "PYTHONPATH": str(self.tree), "COLUMNS": COLUMNS, "LINES": "50", "PYTHONHASHSEED": "0",
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "FREESCALE_LOG_DIR": str(self.work / "logs"), "TZ": "UTC", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8",
            "NO_COLOR": "1", "TERM": "dumb", "GIT_PYTHON_REFRESH": "quiet",
            # The test suite's JVM settings: a faster start, the same results.
            "SPARK_SUBMIT_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        })
        return env

    def run(self, args: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.python, *args], cwd=self.tree, env=self.env, capture_output=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            shown = "-c <inline script>" if args[0] == "-c" else " ".join(args[:4]) + " ..."
            raise CaptureError(f"`python {shown}` exited {proc.returncode}:\n"
                               f"{proc.stdout.decode(errors='replace')[-3000:]}\n"
                               f"{proc.stderr.decode(errors='replace')[-5000:]}")
        return proc

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(["-m", "freescale.jobs.cli", *args], timeout=timeout)

    def code(self, source: str, *args: str, timeout: float = 600) -> str:
        return self.run(["-c", source, *args], timeout=timeout).stdout.decode()

    def norm(self, value):
        """Paths of this capture replaced by placeholders, MLflow's run and model ids and staging
        folders' random suffixes masked (recursively)."""
        if isinstance(value, str):
            for path, mark in ((self.work, "<WORK>"), (self.tree, "<TREE>"), (self.out, "<OUT>")):
                for spelling in sorted({str(path), str(path.resolve())}, key=len, reverse=True):
                    value = value.replace(spelling, mark)
            value = re.sub(r"\bm-[0-9a-f]{32}\b", "m-<ID>", value)
            value = re.sub(r"\b[0-9a-f]{32}\b", "<ID>", value)
            value = re.sub(r"\.tmp-[0-9a-f]{12}\b", ".tmp-<HEX>", value)
            return value
        if isinstance(value, dict):
            return {self.norm(k): self.norm(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.norm(v) for v in value]
        return value

    def write(self, rel: str, data) -> None:
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    def failed(self, rel: str, what: str, error: Exception, **extra) -> None:
        """Record a failed step in its part's file (paths, ids and log names masked), and say it."""
        text = self.norm(str(error))
        text = re.sub(r"-\d{8}-\d{6}-\d+\.log", "-<TIME>.log", text)
        last = [line for line in text.splitlines() if line.strip()]
        self.errors.append(f"{what}: {last[-1][:300] if last else ''}")
        print(f"capture: FAILED {what}: {str(error)[-3000:]}", file=sys.stderr, flush=True)
        self.write(rel, {**extra, "error": what, "error_output": text.splitlines()[-30:]})

    def timed(self, name: str, started: float) -> None:
        self.timings[name] = round(time.perf_counter() - started, 1)
        print(f"capture: {name} done in {self.timings[name]} s", file=sys.stderr, flush=True)

    @property
    def tracking(self) -> str:
        return f"sqlite:///{self.work / 'mlflow.db'}"

    # ------------------------------------------------------------------ help

    def capture_help(self) -> None:
        started = time.perf_counter()
        listing = self.code("import json, freescale.jobs.cli as c; print(json.dumps(list(getattr(c, 'SUBCOMMANDS', ()))))")
        subcommands = list(dict.fromkeys([*BASE_SUBCOMMANDS, *json.loads(listing.strip().splitlines()[-1])]))
        found = sorted(p.stem for p in (self.tree / "freescale" / "jobs").glob("*.py")
                       if p.stem not in ("__init__", "cli") and re.search(r"^if __name__ == ['\"]__main__['\"]",
                                                                          p.read_text(), re.M))
        modules = list(dict.fromkeys([*BASE_MODULES, *found]))
        targets = {"freescale": ["-m", "freescale.jobs.cli", "--help"]}
        targets.update({f"freescale_{sub}": ["-m", "freescale.jobs.cli", sub, "--help"] for sub in subcommands})
        targets.update({f"jobs.{mod}": ["-m", f"freescale.jobs.{mod}", "--help"] for mod in modules})
        status = {}
        for name, args in targets.items():
            proc = self.run(args, timeout=300, check=False)
            (self.out / "help").mkdir(parents=True, exist_ok=True)
            (self.out / "help" / f"{name}.txt").write_bytes(proc.stdout)
            status[name] = {"command": " ".join(["python", *args]), "rc": proc.returncode,
                            "stderr": self.norm(proc.stderr.decode(errors="replace"))}
        self.write("help/_status.json", status)
        self.timed("help", started)

    # ------------------------------------------------------------------ data

    def make_data(self, reuse: Path | None) -> None:
        started = time.perf_counter()
        self.prepared, self.shards = self.work / "prepared", self.work / "shards"
        if reuse is not None:
            shutil.copytree(reuse / "work" / "prepared", self.prepared)
            shutil.copytree(reuse / "work" / "shards", self.shards)
            self.notes.append(f"data reused from {reuse}")
            self.data_lines = {"prepare": None, "balance": None}
        else:
            tracking = ["--tracking-uri", self.tracking, "--experiment", EXPERIMENT]
            prep = self.cli("prepare", "--output", str(self.prepared), "--synthetic-users", str(SYNTHETIC_USERS),
                            "--synthetic-items", str(SYNTHETIC_ITEMS), "--seed", "0", "--master", "local[2]",
                            *tracking)
            bal = self.cli("balance", "--input", str(self.prepared), "--output", str(self.shards), "--world-size",
                           str(WORLD), "--local-batch-size", str(LOCAL_BATCH), "--strategy", "kk", "--seed", "0",
                           "--master", "local[2]", *tracking)
            self.data_lines = {"prepare": self.last_line(prep), "balance": self.last_line(bal)}
        self.timed("data", started)

    def last_line(self, proc: subprocess.CompletedProcess) -> str:
        lines = proc.stdout.decode(errors="replace").strip().splitlines()
        return self.norm(lines[-1]) if lines else ""

    def table_digest(self, files: list[Path], sort_by: str | None = None) -> dict:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(f) for f in files]
        table = pa.concat_tables(tables) if tables else None
        if table is None:
            return {"rows": 0}
        rows = table.to_pylist()
        if sort_by is not None:
            rows.sort(key=lambda r: str(r[sort_by]))
        text = json.dumps(rows, sort_keys=True, default=str)
        return {"rows": len(rows), "columns": sorted(table.column_names),
                "schema": [f"{f.name}: {f.type}" for f in table.schema],
                "sha256": hashlib.sha256(text.encode()).hexdigest()}

    def capture_data(self) -> None:
        started = time.perf_counter()
        parts = lambda d: sorted(p for p in d.glob("*.parquet"))  # noqa: E731
        prepared = {
            "prepare.json": json.loads((self.prepared / "prepare.json").read_text()),
            "files": sorted(str(p.relative_to(self.prepared)) for p in self.prepared.rglob("*")
                            if p.is_file() and not p.name.endswith(".crc") and ".parquet" not in p.name),
            "sequences": self.table_digest(parts(self.prepared / "sequences"), sort_by="user_id"),
            "item_vocab": self.table_digest(parts(self.prepared / "item_vocab"), sort_by="item_id"),
        }
        manifest = json.loads((self.shards / "manifest.json").read_text())
        for key in VOLATILE_MANIFEST:
            manifest.pop(key, None)
        manifest.get("stats", {}).pop("plan_seconds", None)
        (manifest.get("input") or {}).pop("uri", None)
        ranks = []
        for rank in manifest.get("ranks", []):
            files = [self.shards / f["path"] for f in rank.get("files", [])]
            for f in rank.get("files", []):
                # Spark's Parquet writer is not byte-stable from run to run (same rows, other bytes):
                # the rows are compared through rows_in_file_order instead.
                for key in ("path", "sha256", "bytes"):
                    f.pop(key, None)
            ranks.append({"rank": rank.get("rank"), "rows_in_file_order": self.table_digest(files)})
        steps_dir = self.shards / str(manifest.get("step_stats", "_steps"))
        shards = {"manifest": manifest, "ranks": ranks,
                  "step_stats": self.table_digest(parts(steps_dir)) if steps_dir.is_dir() else None}
        self.write("data/prepared.json", self.norm(prepared))
        self.write("data/shards.json", self.norm(shards))
        runs = [self.clean_run(r) for r in self.mlflow_runs() if r["tags"].get("freescale.job") in ("prepare", "balance")]
        self.write("data/jobs.json", {"last_lines": self.data_lines, "mlflow_runs": runs})
        self.timed("data capture", started)

    # ------------------------------------------------------------------ MLflow records

    def mlflow_runs(self) -> list[dict]:
        if not (self.work / "mlflow.db").exists():
            return []
        dump = self.work / "mlflow_runs.json"
        self.code(MLFLOW_DUMP_CODE, self.tracking, EXPERIMENT, str(dump))
        return json.loads(dump.read_text())

    def clean_run(self, run: dict) -> dict:
        metrics, clock = {}, []
        for key, history in sorted(run["metrics"].items()):
            if DETERMINISTIC_METRIC.match(key):
                metrics[key] = history if len(history) > 1 or key.startswith("step/") else history[0][1]
            elif CLOCK_METRIC.search(key):
                clock.append(key)
            else:
                metrics[key] = history if len(history) > 1 else history[0][1]
        tags = {k: v for k, v in run["tags"].items()
                if k not in VOLATILE_TAGS and k != "mlflow.parentRunId" and not k.startswith("mlflow.log-model")}
        inputs = [{k: v for k, v in i.items() if k != "digest"} for i in run["inputs"]]
        return self.norm({"run_name": run["run_name"], "status": run["status"], "params": run["params"],
                          "tags": tags, "metrics": metrics, "clock_metrics_names_only": clock,
                          "artifacts": run["artifacts"], "inputs": inputs})

    # ------------------------------------------------------------------ trainings

    def setup_tracking(self) -> None:
        if not (self.work / "mlflow.db").exists():
            self.code(SETUP_CODE, self.tracking, EXPERIMENT, str(self.work / "mlartifacts"))

    def train_cases(self) -> None:
        self.train_out = {}
        for encoder, mode in CASES:
            started = time.perf_counter()
            case = f"{encoder}_{mode}"
            summary = self.work / "summaries" / f"{case}.json"
            summary.parent.mkdir(parents=True, exist_ok=True)
            try:
                proc = self.cli("train", "--shards", str(self.shards), "--nproc-per-node", str(WORLD),
                                "--max-steps", str(STEPS), "--comm-mode", mode, "--tracking-uri", self.tracking,
                                "--run-name", case, "--summary-json", str(summary),
                                "--tracking.experiment", EXPERIMENT,
                                "--checkpoint.folder", str(self.work / "checkpoints" / case),
                                *COMMON_TRAIN, *ENCODER_ARGS[encoder], timeout=900)
            except (CaptureError, subprocess.TimeoutExpired) as error:
                self.failed(f"losses/{case}.json", f"train {case}", error, case=case)
                continue
            self.train_out[case] = (proc, summary)
            self.timed(f"train {case}", started)

    @staticmethod
    def masked(text: str) -> list[str]:
        """Rank 0's lines with the clock's numbers masked; the summary line is captured as numbers."""
        out = []
        for line in text.splitlines():
            if line.startswith("summary {"):
                continue
            line = re.sub(r"\d+(\.\d+)? (ms|s|min|h)\b", "<T> \\2", line)
            line = re.sub(r"(bubble|exposed comm) [\d.]+%?", "\\1 <X>", line)
            line = re.sub(r"ETA .*$", "ETA <T>", line)
            out.append(line)
        return out

    def capture_losses(self) -> None:
        started = time.perf_counter()
        runs = {r["run_name"]: r for r in self.mlflow_runs() if r["tags"].get("freescale.job") == "train"}
        for case, (proc, summary_path) in self.train_out.items():
            try:
                data = json.loads(summary_path.read_text())
            except (OSError, ValueError) as error:
                self.failed(f"losses/{case}.json", f"summary of {case}", error, case=case)
                continue
            from freescale.costs.run_summary import timing_table

            timings = timing_table(data, summary_path)
            fields = timings.fields
            per_step = {name: timings.column(name).tolist() for name in STEP_FIELDS if name in fields}
            summary = data["summary"]
            kept = {k: v for k, v in sorted(summary.items()) if DETERMINISTIC_METRIC.match(k)}
            record = {
                "case": case, "steps": data["steps"], "losses": data["losses"],
                "per_step_per_rank": per_step, "summary": kept,
                "summary_keys": sorted(summary), "timing_fields": fields,
                "comm": data.get("comm"), "comm_issue_order": data.get("comm_issue_order"),
                "cost_model": data.get("cost_model"), "mlflow_run_id_present": data.get("mlflow_run_id") is not None,
                "summary_json_keys": sorted(data),
                "stdout_masked": self.masked(proc.stdout.decode(errors="replace")),
                "stderr_masked": self.masked(proc.stderr.decode(errors="replace")),
                "checkpoint_files": sorted(str(p.relative_to(self.work / "checkpoints" / case))
                                           for p in (self.work / "checkpoints" / case).rglob("*") if p.is_file()),
                "mlflow_run": self.clean_run(runs[case]) if case in runs else None,
            }
            self.write(f"losses/{case}.json", self.norm(record))
        self.timed("losses capture", started)

    # ------------------------------------------------------------------ export

    def export_fresh(self) -> dict[str, Path]:
        """`freescale export` of each encoder's prioritized checkpoint; its MLflow model, downloaded."""
        models = {}
        for encoder, case in EXPORTED.items():
            started = time.perf_counter()
            try:
                models[encoder] = self.export_one(encoder, case)
            except (CaptureError, subprocess.TimeoutExpired, OSError, ValueError, KeyError, IndexError) as error:
                self.failed(f"export/fresh_{encoder}.json", f"export {encoder}", error, case=case)
            self.timed(f"export {encoder}", started)
        return models

    def export_one(self, encoder: str, case: str) -> Path:
        if case not in self.train_out:
            raise CaptureError(f"no checkpoint: the training {case} failed")
        folder = self.work / "exports" / encoder
        proc = self.cli("export", "--checkpoint", str(self.work / "checkpoints" / case), "--output", str(folder),
                        "--prepared", str(self.prepared), "--tracking-uri", self.tracking,
                        "--experiment", EXPERIMENT)
        logged = json.loads((folder / "mlflow.json").read_text())
        dst = self.work / "mlflow_models" / encoder
        dst.mkdir(parents=True, exist_ok=True)
        downloaded = Path(self.code(DOWNLOAD_CODE, self.tracking, logged["model_uri"], str(dst))
                          .strip().splitlines()[-1])
        predictions = self.work / "predictions" / f"{encoder}.json"
        predictions.parent.mkdir(parents=True, exist_ok=True)
        self.code(PREDICT_CODE, str(downloaded), str(predictions))
        self.write(f"export/fresh_{encoder}.json", self.norm({
            "case": case, "last_line": self.last_line(proc),
            "folder_files": sorted(p.name for p in folder.iterdir()),
            "model.json": json.loads((folder / "model.json").read_text()),
            "evaluation.json": json.loads((folder / "evaluation.json").read_text()),
            "item_vocab_sha256": hashlib.sha256((folder / "item_vocab.json").read_bytes()).hexdigest(),
            "weights": json.loads(self.code(TENSORS_CODE, str(folder / "weights.pt")).strip().splitlines()[-1]),
            "mlflow_json_keys": sorted(logged),
            "mlmodel": self.mlmodel(downloaded),
            "mlflow_model_files": sorted(str(p.relative_to(downloaded)) for p in downloaded.rglob("*")
                                         if p.is_file()),
            "predictions": json.loads(predictions.read_text()),
        }))
        return downloaded

    def mlmodel(self, model_dir: Path):
        import yaml  # mlflow's dependency

        meta = yaml.safe_load((model_dir / "MLmodel").read_text())
        return {k: v for k, v in meta.items() if k not in MLMODEL_VOLATILE}

    def predict_model(self, model: Path) -> None:
        started = time.perf_counter()
        out = self.work / "predictions" / "model.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.code(PREDICT_CODE, str(model), str(out))
            self.write("export/top10.json", {"model": str(model), "predictions": json.loads(out.read_text())})
        except (CaptureError, subprocess.TimeoutExpired, OSError, ValueError) as error:
            self.failed("export/top10.json", "predict --model", error, model=str(model))
        self.timed("predict --model", started)


def git_head(tree: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or None
    except OSError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="the FreeScale checkout to capture")
    p.add_argument("--out", required=True, help="folder to write (created; must not hold a capture already)")
    p.add_argument("--export-to", help="copy the fresh hstu export's MLflow model here (baseline only; must not exist)")
    p.add_argument("--model", help="an exported MLflow model folder: load it with mlflow.pyfunc and write "
                                   "export/top10.json")
    p.add_argument("--parts", default="help,data,losses,export",
                   help="comma-separated subset of help,data,losses,export (default all)")
    p.add_argument("--reuse-data", metavar="CAPTURE_DIR",
                   help="train on another capture's prepared data and shards (its work/) instead of making them")
    p.add_argument("--python", default=sys.executable, help="interpreter for the tree (default: this one)")
    args = p.parse_args()

    tree, out = Path(args.tree).resolve(), Path(args.out).resolve()
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    unknown = parts - {"help", "data", "losses", "export"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] not in (str(tree), args.tree):
        print(f"capture: note: PYTHONPATH is not {tree}; the children get PYTHONPATH={tree} anyway", file=sys.stderr)
    if args.export_to and Path(args.export_to).exists():
        p.error(f"--export-to {args.export_to} exists: the baseline model is never overwritten")
    if args.export_to and "export" not in parts:
        p.error("--export-to needs the export part")
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    cap = Capture(tree, out, args.python)
    cap.work.mkdir(parents=True)
    started = time.perf_counter()
    have_data = False
    if "help" in parts:
        cap.capture_help()
    if parts & {"data", "losses", "export"}:
        cap.setup_tracking()
        try:
            cap.make_data(Path(args.reuse_data).resolve() if args.reuse_data else None)
            if "data" in parts:
                cap.capture_data()
            have_data = True
        except (CaptureError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as error:
            cap.failed("data/error.json", "data", error)
            have_data = False
    if parts & {"losses", "export"} and have_data:
        cap.train_cases()
        if "losses" in parts:
            cap.capture_losses()
    if "export" in parts and have_data:
        models = cap.export_fresh()
        if args.export_to and "hstu" not in models:
            cap.errors.append(f"--export-to {args.export_to}: not written, the hstu export failed")
        elif args.export_to:
            shutil.copytree(models["hstu"], args.export_to)
            cap.notes.append(f"exported the hstu MLflow model to {Path(args.export_to).resolve()}")
    if args.model:
        cap.predict_model(Path(args.model).resolve())
    cap.timings["total"] = round(time.perf_counter() - started, 1)
    (out / "meta.json").write_text(json.dumps({
        "tree": str(tree), "git_head": git_head(tree), "python": args.python, "parts": sorted(parts),
        "model": args.model, "export_to": args.export_to, "timings_s": cap.timings, "notes": cap.notes,
        "errors": cap.errors,
        "settings": {"steps": STEPS, "world_size": WORLD, "local_batch_size": LOCAL_BATCH,
                     "synthetic_users": SYNTHETIC_USERS, "synthetic_items": SYNTHETIC_ITEMS,
                     "cases": [f"{e}_{m}" for e, m in CASES], "common_train": COMMON_TRAIN,
                     "encoder_args": ENCODER_ARGS},
    }, indent=1) + "\n")
    print(f"capture: wrote {out} in {cap.timings['total']} s"
          + (f"; {len(cap.errors)} step(s) FAILED: " + "; ".join(cap.errors) if cap.errors else ""), file=sys.stderr)
    return 1 if cap.errors else 0


if __name__ == "__main__":
    sys.exit(main())
