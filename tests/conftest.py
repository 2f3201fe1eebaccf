"""Fixtures shared by every test area: the tiny model, the single-process ground truth, and
a KV store as real processes (master + storage nodes, for the store client tests under
tests/store and the storage node tests under tests/kvstore)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

# `make check`'s guard: a test that starts a process must be marked slow (process_guard.py)
from process_guard import pytest_configure, pytest_runtest_protocol  # noqa: F401

from pdserve import procs

#: Test folders whose files share one started cluster through a package-scoped fixture: under
#: pytest-xdist with ``--dist loadfile`` (``make test``) each runs whole on one test worker, so
#: its fixture starts once.
SHARED_FOLDERS = ("tests/vllm_services/",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``, with the files of a :data:`SHARED_FOLDERS` folder kept together and
    handed out in collection order (the vLLM files first, :func:`pytest_collection_modifyitems`):
    xdist's own order, most tests first, left the longest files, the vLLM ones, to the end."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class SharedScopeScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((f for f in SHARED_FOLDERS if path.startswith(f)), path)

    return SharedScopeScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with vLLM tests (the longest: an engine takes tens of seconds to start)
    first, so that the test workers finish together, not one alone on a long file at the end."""
    heavy = {item.path for item in items if item.get_closest_marker("vllm") is not None}
    items.sort(key=lambda item: item.path not in heavy)  # stable: a file stays together


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny Llama (built once into the model cache)."""
    from pdserve.model.prepare import build_tiny_model

    return Path(build_tiny_model())


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """``hf_greedy(prompt_ids, n)``: the first ``n`` greedy tokens of a plain transformers loop
    in this process (whole prompt in one forward, then one token at a time), stopping after
    EOS. The ground truth every disaggregated path must match token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    eos = model.config.eos_token_id

    @torch.inference_mode()
    def run(prompt: Sequence[int], n: int) -> list[int]:
        out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        toks: list[int] = []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
            if tok == eos:
                break
            out = model(
                input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True
            )
        return toks

    @torch.inference_mode()
    def next_logits(ids: Sequence[int]) -> torch.Tensor:
        """The model's logits for the token after ``ids`` (one forward of all of them)."""
        return model(input_ids=torch.tensor([list(ids)])).logits[0, -1]

    run.next_logits = next_logits  # type: ignore[attr-defined]
    return run


class StoreCluster:
    """A KV store master plus storage nodes (:mod:`pdserve.procs`); ``close`` stops all."""

    def __init__(self, log_dir: Path, **master_flags: object) -> None:
        self.log_dir = log_dir
        self.master = procs.start_master(log_dir, **master_flags)
        self.nodes: list[procs.ServiceProcess] = []

    @property
    def address(self) -> str:
        return self.master.info["grpc"]

    def add_node(self, **kwargs) -> procs.ServiceProcess:
        """Starts a node (``kwargs`` as :func:`pdserve.procs.start_node`) stopped at close."""
        node = procs.start_node(self.address, self.log_dir, **kwargs)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
            procs.remove_shm(node)
        self.master.stop()


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[[], StoreCluster]]:
    """``cluster_factory(**master_flags)``: a fresh master (add nodes with ``add_node``),
    stopped after."""
    made: list[StoreCluster] = []

    def make(**master_flags: object) -> StoreCluster:
        c = StoreCluster(tmp_path / f"logs{len(made)}", **master_flags)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreCluster]:
    """One master and two nodes serving shm, tcp and (when installed) mooncake."""
    from pdserve.store.transports.mooncake import available

    c = StoreCluster(tmp_path_factory.mktemp("cluster"))
    transports = "shm,tcp,mooncake" if available() else "shm,tcp"
    try:
        c.add_node(transports=transports)
        c.add_node(transports=transports)
        yield c
    finally:
        c.close()
