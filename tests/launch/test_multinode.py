"""`freescale train` on several nodes: each node runs it with --nnodes, --node-rank and node 0's
--rdzv-endpoint; here two nodes on this machine, one rank each, against one node of two ranks; and
node 0 alone, which gives up at --rdzv-timeout. And the launcher's own checks, which answer before
torchrun starts."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests import helpers
from tests.scenarios import LONE_NODE_TIMEOUT_S

STEPS = 8


class NoProcesses:
    """freescale.launch.launcher's `subprocess` for launches that must stop before starting torchrun."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the launcher used subprocess.{name}")


@pytest.mark.parametrize("args, message", [
    (["--shards", "/nonexistent/dir"], "--shards /nonexistent/dir: no such directory"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT (node 0's address), got none"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"],
     "--nnodes 2 needs --rdzv-endpoint HOST:PORT (node 0's address), got 127.0.0.1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
     "--node-rank must be in 0..1 for --nnodes 2, got 2"),
    (["--nnodes", "0"], "--nnodes must be a positive integer, got 0"),
    (["--rdzv-endpoint", "127.0.0.1:29400"], "--rdzv-endpoint is for --nnodes > 1 (one node meets itself)"),
    (["--rdzv-timeout", "5"], "--rdzv-timeout is for --nnodes > 1 (one node waits for no other)"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-timeout", "0"],
     "--rdzv-timeout must be a positive number of seconds, got 0"),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
])
def test_a_bad_launch_is_one_line_before_torchrun(movielens_shards, monkeypatch, capsys, args, message):
    from freescale.jobs import cli
    from freescale.launch import launcher

    monkeypatch.setattr(launcher, "subprocess", NoProcesses())
    if "--shards" not in args:
        args = ["--shards", str(movielens_shards), *args]
    assert cli.main(["train", *args, "--tracking-uri", "none"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [helpers.without_details(line) for line in lines] == [f"freescale train: error: {message}"]


def test_nodes_must_divide_the_manifests_ranks(movielens_shards_1, monkeypatch, capsys):
    from freescale.jobs import cli
    from freescale.launch import launcher

    monkeypatch.setattr(launcher, "subprocess", NoProcesses())
    assert cli.main(["train", "--shards", str(movielens_shards_1), "--nnodes", "2",
                     "--rdzv-endpoint", "127.0.0.1:29400", "--tracking-uri", "none"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [helpers.without_details(line) for line in lines] == [
        f"freescale train: error: {movielens_shards_1 / 'manifest.json'} is for 1 ranks, which --nnodes 2 "
        f"does not divide: pass --nproc-per-node"]


def test_the_rdzv_timeout_is_the_one_torchruns_c10d_rendezvous_applies():
    """The nodes meet in torchrun's c10d rendezvous (a restarted node meets the others again), whose
    own join timeout (600 s) is not the one `freescale train` names: it passes its own, which c10d
    reads, and node 0 hosts the rendezvous's store."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _get_timeout
    from torch.distributed.run import _parse_rendezvous_config

    from freescale.launch.launcher import RDZV_TIMEOUT_S, rendezvous_options

    for node, timeout in ((0, None), (1, 7)):
        options = rendezvous_options(2, node, "127.0.0.1:29400", timeout)
        assert "--rdzv-backend=c10d" in options
        [conf] = [option.split("=", 1)[1] for option in options if option.startswith("--rdzv-conf=")]
        params = RendezvousParameters("c10d", "127.0.0.1:29400", "none", 2, 2, **_parse_rendezvous_config(conf))
        assert _get_timeout(params, "join") == timedelta(seconds=timeout or RDZV_TIMEOUT_S)
        assert params.get_as_int("read_timeout") == (timeout or RDZV_TIMEOUT_S)
        assert params.get_as_bool("is_host") == (node == 0)


# What torchrun (torch 2.13) printed when it gave up, on node 0 (its c10d rendezvous, which names
# no count) and on node 1 (whose store client logs each failed try, and raises after the last).
NODE_0_GAVE_UP = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"
NODE_1_GAVE_UP = ("[W1205 05:46:31.017539997 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to "
                  "host 127.0.0.1:29517 - retrying (try=0, timeout=10000ms, delay=7061ms): The client socket has "
                  "timed out after 10000ms while trying to connect to (127.0.0.1, 29517).\n"
                  "torch.distributed.DistNetworkError: The client socket has timed out after 10000ms while trying "
                  "to connect to (127.0.0.1, 29517).\n")
IN_USE = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
          "address. port: 29517, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")


@pytest.mark.parametrize("said, gave_up, reason, code", [
    (NODE_0_GAVE_UP, False, "timed out after 10 s: not all 2 nodes joined", 3),
    (NODE_1_GAVE_UP, False, "timed out after 10 s: node 0 did not answer there", 3),
    # This launcher stopped torchrun past the timeout: what its store client had logged by then.
    (NODE_1_GAVE_UP.splitlines()[0], True, "timed out after 10 s: node 0 did not answer there", 3),
    ("", True, "timed out after 10 s: not all 2 nodes joined", 3),
    (IN_USE, False, "failed: DistNetworkError: The server socket has failed to listen on any local network address. "
                    "port: 29517, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", 3),
    ("ModuleNotFoundError: No module named 'torch.distributed.run'\n", False,
     "failed: torchrun exited with status 1 before the 2 nodes met", 1),
])
def test_a_failed_rendezvous_says_what_torchrun_knew(said, gave_up, reason, code):
    from freescale.launch.launcher import RendezvousWait

    waiting = RendezvousWait("127.0.0.1:29517", 2, 10, say=print)
    waiting.gave_up = gave_up
    assert waiting._reason(1, said) == (reason, code)


def test_a_node_alone_gives_up_at_the_rdzv_timeout(lone_node):
    """Node 0 of 2 with node 1 never started (tests/scenarios.py's lone_node): a line when it starts
    waiting, and past --rdzv-timeout one error line naming the endpoint,
    exit 3, nothing left running. The ranks never start, so an empty shard folder does."""
    run, endpoint = lone_node, lone_node.endpoint
    assert run.first == f"freescale train: waiting for 2 nodes at {endpoint}, up to {LONE_NODE_TIMEOUT_S} s\n"
    assert run.ended - run.said_at >= LONE_NODE_TIMEOUT_S  # said when the wait began, not when it ended
    assert run.returncode == 3, run.rest
    assert run.out == ""
    [last] = run.rest.splitlines()
    assert re.fullmatch(rf"freescale train: error: rendezvous at {re.escape(endpoint)} timed out after "
                        rf"{LONE_NODE_TIMEOUT_S} s: not all 2 nodes joined \(details: .+\.log\)", last), last
    assert run.ended - run.started < LONE_NODE_TIMEOUT_S + 30
    assert helpers.processes_with("FREESCALE_TEST_RDZV", run.marker) == []


def train_nodes(shards, tmp_path, name: str, nodes: list[list[str]]) -> tuple[list[subprocess.CompletedProcess],
                                                                               dict[int, dict[str, str]]]:
    """`freescale train` once per entry of `nodes` (that node's own options), all at once, STEPS steps of
    a small model on one thread per rank; the finished launches, and each rank's environment as
    torchrun started it (read while it ran)."""
    marker = str(tmp_path / name)
    procs = []
    for own in nodes:
        cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--max-steps", str(STEPS),
               # One thread per rank in both layouts: a node that believes it has the machine to itself
               # would give its one rank every core, and the comparison is of the launch, not of threads.
               "--training.threads", "1", *own, *helpers.small_run_args(tmp_path, name)]
        procs.append(subprocess.Popen(cmd, cwd=helpers.REPO, env=helpers.train_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    try:
        environs = {rank: helpers.environ_of(helpers.rank_process(rank, marker)) for rank in (0, 1)}
        outputs = [proc.communicate(timeout=helpers.TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                helpers.kill_tree(proc.pid)
                proc.wait()
    runs = [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outputs)]
    return runs, environs


@pytest.mark.slow
@pytest.mark.extended
def test_two_nodes_train_the_losses_of_one_node_of_two_ranks(movielens_shards, tmp_path):
    [one], one_env = train_nodes(movielens_shards, tmp_path, "one-node", [["--nproc-per-node", "2"]])
    assert one.returncode == 0, one.stderr[-3000:]
    endpoint = f"127.0.0.1:{helpers.free_port()}"
    # Without --nproc-per-node: the manifest's 2 ranks over 2 nodes.
    runs, two_env = train_nodes(movielens_shards, tmp_path, "two-nodes",
                                [["--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint]
                                 for node in (1, 0)])  # node 1 first: it waits for node 0
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stderr.splitlines()
        assert f"freescale train: waiting for 2 nodes at {endpoint}, up to 900 s" in lines
        assert any(re.fullmatch(rf"freescale train: all 2 nodes joined at {re.escape(endpoint)} after \d+ s", line)
                   for line in lines), lines

    def layout(environs):
        keys = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
        return {rank: tuple(int(env[key]) for key in keys) for rank, env in environs.items()}

    assert layout(one_env) == {0: (0, 0, 0, 2, 2), 1: (1, 0, 1, 2, 2)}
    assert layout(two_env) == {0: (0, 0, 0, 1, 2), 1: (1, 1, 0, 1, 2)}
    one_losses = json.loads((tmp_path / "one-node.json").read_text())["losses"]
    two_losses = json.loads((tmp_path / "two-nodes.json").read_text())["losses"]
    assert len(one_losses) == STEPS
    assert two_losses == one_losses  # to the last bit
    # The node the rendezvous gave rank 0 (not necessarily --node-rank 0's) shows the progress lines.
    [shown] = [run for run in runs if f"step {STEPS}/{STEPS}" in run.stdout]
    assert all("step " not in run.stdout for run in runs if run is not shown)

    # comm.backend copy_engine's one-node rule, on what each launch gave its ranks.
    from freescale.comm import cuda
    from freescale.comm.errors import BackendUnavailable

    with pytest.MonkeyPatch.context() as env:
        for name, value in one_env[1].items():
            if name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.setenv(name, value)
        cuda._require_one_node()
        for name, value in two_env[1].items():
            if name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.setenv(name, value)
        with pytest.raises(BackendUnavailable, match="world size 2, 1 ranks on this node"):
            cuda._require_one_node()
