"""The test run's environment (every test, and every example of the README and ``docs/``), and
the examples themselves: each Python block of ``README.md`` and ``docs/*.md`` runs as a test
(Sybil; the blocks of one page share a namespace, in order). A block that needs a GPU or minutes
is skipped by name (``<!-- skip: next "needs a CUDA GPU" -->``), never silently; a hidden setup
block (``<!-- invisible-code-block: python ... -->``) gives a page's examples their model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the checks' default ("auto") compiles each check region on first use, seconds per dtype and
# layout: the suite runs their eager ops, and tests/integration/test_check_regions.py runs the
# compiled regions against them (same records, same repairs, no false alarm)
os.environ.setdefault("ATTNCHECKER_CHECK_IMPL", "eager")

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers on two cores, one thread
    torch.set_num_threads(1)  # each (two each oversubscribe the cores: 6.8 min, was 9.3)

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before they are
    os.environ.setdefault("TRITON_INTERPRET", "1")  # decorated (attnchecker.kernels imports)

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def _page(namespace: dict) -> None:
    """What every page's examples start from (the pages say so): ``torch``, ``attnchecker``,
    ``ABFTConfig``, a tiny GPT-2 ``model``, a ``batch`` of it and a ``loader`` of two, an
    ``optimizer``; and a directory of their own (what they write stays there)."""
    import tempfile

    import attnchecker
    from attnchecker.models.source import make

    model = make("gpt2", size="tiny", seed=0)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    namespace.update(torch=torch, attnchecker=attnchecker, ABFTConfig=attnchecker.ABFTConfig,
                     model=model, batch=batch, loader=[batch, batch],
                     optimizer=torch.optim.AdamW(model.parameters()))  # fmt: skip
    namespace["_cwd"] = os.getcwd()
    namespace["_tmp"] = tempfile.TemporaryDirectory()
    os.chdir(namespace["_tmp"].name)


def _back(namespace: dict) -> None:
    os.chdir(namespace["_cwd"])
    namespace["_tmp"].cleanup()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    setup=_page,
    teardown=_back,
).pytest()
