"""torchtitan's Llama 3 (a dev dependency, torchtitan 0.2.2) under FSDP2 x tensor parallel,
2 x 2 on four gloo processes, protected by the ``attnchecker`` model converter from a TOML job
config, and parallelized by torchtitan's own ``parallelize_llama``.

torchtitan's trainer needs CUDA (it sets ``cuda:<LOCAL_RANK>``), so a loop of this test's own
drives what it would: the model built on the meta device, the converters, ``parallelize_llama``,
``to_empty`` + ``init_weights``, torchtitan's ``build_optimizers`` (AdamW) with the converters'
post-optimizer hook on it, a cross-entropy step. Two patches make it run on a CPU: the meshes
are built on "cpu" (torchtitan's module constant says "cuda"), and FSDP's gradient division is
left on (torchtitan turns it off with a pre-multiplied reduce-scatter that gloo lacks; both arms
alike).

Asserted, on every rank: the protected clean run equals the unprotected one (loss and every
parameter, fp32, 1e-5); 50 clean steps report nothing; a fault at every attention site
(forward and backward GEMMs, the core's scores, probabilities and context) and in linear layers
(column- and row-split, forward and both backward GEMMs), injected into every rank's own shard
in the same step, is corrected in that step (the run ends equal to the clean run), each event
names the rank and its mesh coordinates; an uncorrectable fault on one rank skips that step on
all four (parameters unchanged everywhere), through the guard torchtitan's optimizer container
was rerouted to.
"""

from __future__ import annotations

import collections
import math
import os

import pytest
import torch

pytestmark = pytest.mark.distributed
pytest.importorskip("torchtitan.models.llama3.infra.parallelize")

DP, TP = 2, 2
STEPS_CLEAN = 50
COMPARE_AT = 4  # the unprotected run's steps
PROFILED = 2  # the step whose collectives are counted (after the first: the guard rerouted)
TOML = """
[job]
custom_config_module = "attnchecker.integrations.torchtitan"
[model]
converters = ["attnchecker"]
[training]
local_batch_size = 2
seq_len = 16
mixed_precision_param = "float32"
[parallelism]
data_parallel_shard_degree = 2
tensor_parallel_degree = 2
disable_loss_parallel = true
[optimizer]
implementation = "for-loop"
[attnchecker]
scope = "all_linear"
policy = "skip_step"
max_heads = 1
"""
ATTENTION = ("q", "k", "v", "out", "scores", "probs", "context", "dq", "dk", "dp", "dv",
             "dx.q", "dw.q", "dx.k", "dw.k", "dx.v", "dw.v", "dx.out", "dw.out")  # fmt: skip
FF = "feed_forward"
LINEAR = ((f"{FF}.w1", "y"), (f"{FF}.w2", "y"), (f"{FF}.w3", "dx"), (f"{FF}.w2", "dw"),
          (f"{FF}.w1", "dw"), (f"{FF}.w2", "dx"))  # fmt: skip
KINDS = (math.inf, math.nan, -math.inf, 1e10)
ROUTE_REPORTED = {"probs": ("context",), "dp": ("dq", "dk")}  # (test_protect_sdpa_route)


def _job(tmp: str, converters: bool, *args: str):
    """The job from :data:`TOML` (without the converter: the unprotected run), and ``args``
    as torchtitan's command line would override it."""
    from torchtitan.config import ConfigManager

    path = os.path.join(tmp, f"job{int(converters)}.toml")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(TOML if converters else TOML.replace('["attnchecker"]', "[]"))
    return ConfigManager().parse_args(["--job.config_file", path, *args])


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, 128, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(job, dims, steps: int, faults: dict, record: tuple[int, ...]):
    """Train ``steps`` steps as torchtitan's trainer would; ``faults``: step -> (module name,
    site, edit) injected on this rank. Returns (losses, events by step, params at ``record``
    steps and the profiled step's collectives, the converter, its summary before it is
    closed)."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer
    from torchtitan.protocols.model_converter import build_model_converters

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                                max_seq_len=32)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(args)
    converters = build_model_converters(job, dims)
    converters.convert(model)
    parallelize_llama(model, dims, job)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    optimizers = build_optimizers([model], job.optimizer, dims)
    optimizers.register_step_post_hook(lambda *a, **k: converters.post_optimizer_hook([model]))
    ours = [c for c in converters.converters if hasattr(c, "handle")]
    conv = ours[0] if ours else None
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    losses, events, params = [], {}, {"collectives": collections.Counter()}
    for step in range(1, steps + 1):
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if step == PROFILED:  # the step's collectives, as gloo records them
            profile.__enter__()
        detach = None
        detach = [conv.handle.attach(edit, sites=(site,), modules=(name,))
                  for name, site, edit in faults.get(step, ())]  # fmt: skip
        x, y = _batch(step, dp_rank)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        for d in detach:
            d.remove()
        seen = len(conv.events) if conv else 0
        optimizers.step()
        optimizers.zero_grad()
        if step == PROFILED:
            profile.__exit__(None, None, None)
            names = [e.name for e in profile.events() if e.name.startswith("gloo:")]
            params["collectives"].update(names)
        losses.append(float(loss))
        if conv is not None:
            events[step] = conv.events[seen:]
        if step in record:
            params[step] = {
                n.replace("._checkpoint_wrapped_module", ""): p.full_tensor().detach().clone()
                for n, p in model.named_parameters()
            }
    summary = None
    if conv is not None:  # its optimizer hook and protection removed, as a run ends
        summary = conv.handle.summary()
        conv.close()
    return losses, events, params, conv, summary


def _edit(value: float):
    def edit(call) -> None:
        t = call.tensor
        t[(0,) * (t.dim() - 1) + (1,)] = value

    return edit


def _beyond(call) -> None:  # NaN in both of this rank's heads: beyond max_heads = 1
    call.tensor[:, :, 2, 2] = math.nan


def _rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3.infra.parallelize as parallelize

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    parallel_dims.device_type = "cpu"  # torchtitan's meshes on the CPU
    torch.set_num_threads(1)  # four processes on the machine's cores
    parallelize.disable_fsdp_gradient_division = lambda model: None  # gloo: no PREMUL_SUM
    # a file store, not a TCP port chosen in advance: another test's gloo could take that port
    # before rank 0 listened on it, and ranks connecting to the wrong listener abort in gloo
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        from torchtitan.distributed import ParallelDims

        dims = ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=TP, pp=1, ep=1, etp=1,
                            world_size=world)  # fmt: skip
        dims.build_mesh()
        plain = _run(_job(out, False), dims, COMPARE_AT, {}, (COMPARE_AT,))
        job = _job(out, True)
        faults, step = {}, 0
        sites = [(f"layers.{i % 2}.attention.inner_attention", s) for i, s in enumerate(ATTENTION)]
        sites += [(f"layers.{i % 2}.{m}", s) for i, (m, s) in enumerate(LINEAR)]
        for i, (name, site) in enumerate(sites):  # two a step: one in each layer
            step = i // 2 + 1
            faults.setdefault(step, []).append((name, site, _edit(KINDS[i % len(KINDS)])))
        last = step + 1  # one rank's uncorrectable fault: every rank skips
        if rank == 3:
            faults[last] = [("layers.1.attention.inner_attention", "scores", _beyond)]
        clean = _run(job, dims, STEPS_CLEAN, {}, (COMPARE_AT, step, last))
        faulty = _run(job, dims, last, faults, (step, last))
        # the SDPA route (the CUDA default; on the CPU's flash kernel here), under full
        # activation checkpointing: the same faults, corrected
        route_job = _job(out, True, "--attnchecker.backend", "sdpa",
                         "--activation_checkpoint.mode", "full")  # fmt: skip
        route = _run(route_job, dims, step, faults, (step,))
        result = {
            "plain": (plain[0], plain[2]),
            "collectives": (plain[2]["collectives"], clean[2]["collectives"]),
            "clean": (clean[0], clean[1], clean[2]),
            "faulty": (faulty[0], faulty[1], faulty[2], faulty[3].skipped_steps),
            "route": (route[0], route[1], route[2], route[4]),
            "sites": {s: f for s, f in faults.items() if s != last},
            "last": last,
            "guarded": len(faulty[3].guarded),
        }
        result["sites"] = {s: sorted((n, site) for n, site, _ in f)
                           for s, f in result["sites"].items()}  # fmt: skip
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ranks(tmp_path_factory):
    import multiprocessing

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("titan")
    # forked from one server that imported torchtitan and attnchecker once (four fresh
    # interpreters each importing them took ~30 s of the test on two cores)
    preload = [__name__, "attnchecker.integrations.torchtitan",
               "torchtitan.models.llama3.infra.parallelize"]  # fmt: skip
    multiprocessing.set_forkserver_preload(preload)
    mp.start_processes(_rank, args=(DP * TP, str(out)), nprocs=DP * TP, join=True,
                       start_method="forkserver")  # fmt: skip
    return [torch.load(out / f"rank{r}.pt") for r in range(DP * TP)]


def _protected_clean_steps_equal_the_unprotected_run(ranks):
    for r in ranks:
        plain_loss, plain_params = r["plain"]
        clean_loss, _, clean_params = r["clean"]
        torch.testing.assert_close(clean_loss[:COMPARE_AT], plain_loss, rtol=1e-5, atol=1e-6)
        for n, p in plain_params[COMPARE_AT].items():
            torch.testing.assert_close(clean_params[COMPARE_AT][n], p, rtol=1e-5, atol=1e-6)


def _a_clean_step_adds_one_collective_the_guards_flag(ranks):
    """The collectives of one step, as gloo records them (the profiler): the protected step
    has the unprotected one's (FSDP's all-gathers and reduce-scatters, the tensor-parallel
    reductions: 41 on each rank here) and one all-reduce more, of the guard's flag. The checks
    add none."""
    for r in ranks:
        plain, protected = r["collectives"]
        assert plain["gloo:all_gather"] > 0  # FSDP2's (its reduce-scatter is an all-reduce
        assert plain["gloo:all_reduce"] > 1  # on gloo) and the tensor-parallel reductions
        added = protected - plain
        assert added == collections.Counter({"gloo:all_reduce": 1}), (plain, protected)
        assert not plain - protected


def _fifty_clean_steps_report_nothing(ranks):
    for r in ranks:
        events = r["clean"][1]
        assert len(events) == STEPS_CLEAN
        assert [e for step in events.values() for e in step] == []


def _every_site_on_every_rank_is_corrected_in_its_step(ranks):
    coords = {(r["faulty"][1][1][0]["mesh"]["fsdp"], r["faulty"][1][1][0]["mesh"]["tp"])
              for r in ranks}  # fmt: skip
    assert coords == {(0, 0), (0, 1), (1, 0), (1, 1)}  # each rank names its place in the mesh
    for rank, r in enumerate(ranks):
        events = r["faulty"][1]
        for step, sites in r["sites"].items():
            got = sorted((e["module"], e["op"], e["action"], e["rank"]) for e in events[step])
            assert got == [(n, s, "corrected", rank) for n, s in sites], (rank, step, sites)
        # corrected in the step: the run is where the clean run was
        done = r["last"] - 1
        for n, p in r["clean"][2][done].items():
            torch.testing.assert_close(r["faulty"][2][done][n], p, rtol=1e-5, atol=1e-6)


def _the_sdpa_route_under_full_checkpointing_corrects_them_too(ranks):
    for rank, r in enumerate(ranks):
        summary = r["route"][3]["per_module"]["layers.0.attention.inner_attention"]
        assert summary["engine"] == "sdpa", summary  # the route ran, not the eager engine
        events = r["route"][1]
        for step, sites in r["sites"].items():
            assert {e["module"] for e in events[step]} == {n for n, _ in sites}, (rank, step)
            for n, s in sites:  # the route reports P's fault in O, dP's in dQ / dK
                ops = {e["op"] for e in events[step] if e["module"] == n}
                assert ops and ops <= set(ROUTE_REPORTED.get(s, (s,))), (rank, step, s, ops)
            assert all(e["action"] != "uncorrectable" for e in events[step]), (rank, step)
            assert {e["rank"] for e in events[step]} == {rank}
        done = r["last"] - 1
        for n, p in r["clean"][2][done].items():
            torch.testing.assert_close(r["route"][2][done][n], p, rtol=1e-5, atol=1e-6)


def _an_uncorrectable_fault_on_one_rank_skips_the_step_on_all(ranks):
    """Rank 3's NaN scores are beyond repair: a computation fault there. Its tensor-parallel
    peer (rank 2) receives the NaN through the row-split layers' reduction and reports what it
    then sees as numerics (its GEMMs agree with their NaN operands: not its hardware); the
    other FSDP group sees nothing until the gradients' reduction. Every rank skips the step."""
    for rank, r in enumerate(ranks):
        assert r["guarded"] == 1  # torchtitan's one AdamW, rerouted through the guard
        last = r["last"]
        got = {(e["module"], e["op"], e["action"], e["cause"]) for e in r["faulty"][1][last]}
        faults = {g for g in got if g[3] == "fault"}
        if rank == 3:  # (the core's later checks see the NaN rows too, in the same module)
            assert ("layers.1.attention.inner_attention", "scores", "uncorrectable",
                    "fault") in faults  # fmt: skip
            assert {g[0] for g in faults} == {"layers.1.attention.inner_attention"}
        else:
            assert faults == set(), rank
            assert (got != set()) == (rank == 2), rank
        assert r["faulty"][3] == 1  # skipped on every rank
        before, after = r["faulty"][2][last - 1], r["faulty"][2][last]
        assert all(torch.equal(after[n], p) for n, p in before.items())  # nothing moved


def test_fsdp2_x_tensor_parallel_through_the_converter(tmp_path_factory):
    """One test item: the four processes run once (a module fixture under xdist's work
    stealing ran once a worker), then each claim of the module docstring."""
    ranks = _ranks(tmp_path_factory)
    _protected_clean_steps_equal_the_unprotected_run(ranks)
    _a_clean_step_adds_one_collective_the_guards_flag(ranks)
    _fifty_clean_steps_report_nothing(ranks)
    _every_site_on_every_rank_is_corrected_in_its_step(ranks)
    _the_sdpa_route_under_full_checkpointing_corrects_them_too(ranks)
    _an_uncorrectable_fault_on_one_rank_skips_the_step_on_all(ranks)
