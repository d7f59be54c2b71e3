"""The ``attnchecker`` torchtitan model converter in one process: its ``[attnchecker]`` TOML
section (and torchtitan's command-line overrides of it) reaching the config, what it refuses by
name before anything is built, and torchtitan's per-block ``torch.compile`` (fullgraph, each
TransformerBlock) of a model protected on the SDPA route: equal to the protected model run
eagerly, nothing reported, no recompilation after the first step. The four-process FSDP2 x TP
run is ``test_torchtitan_parallel.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3.infra.parallelize")

from attnchecker.errors import ConfigError
from attnchecker.integrations import torchtitan as converter

NAME = "layers.0.attention.inner_attention"
TOML = """
[job]
custom_config_module = "attnchecker.integrations.torchtitan"
[model]
converters = ["attnchecker"]
[training]
local_batch_size = 2
seq_len = 16
[activation_checkpoint]
mode = "none"
[attnchecker]
policy = "raise"
scope = "all_linear"
"""


def _job(tmp_path, *args: str, toml: str = TOML):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(toml)
    return ConfigManager().parse_args(["--job.config_file", str(path), *args])


def _dims(**degrees):
    from torchtitan.distributed import ParallelDims

    d = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1)
    d.update(degrees)
    world = d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"]
    return ParallelDims(**d, world_size=world)


def _converter(job, dims=None):
    from torchtitan.protocols.model_converter import build_model_converters

    (conv,) = build_model_converters(job, dims or _dims()).converters
    assert isinstance(conv, converter.AttnCheckerConverter)  # registered by the import
    return conv


def test_the_toml_section_and_command_line_reach_the_config(tmp_path):
    conv = _converter(_job(tmp_path, "--attnchecker.max_heads", "1"))
    config = conv.config
    assert (config.policy, config.scope, config.max_heads) == ("raise", "all_linear", 1)
    assert conv.batch == (2, 16)
    assert conv.report_every == 10  # torchtitan's metrics.log_freq
    default = _converter(_job(tmp_path, toml=TOML.split("[attnchecker]")[0]))
    assert default.config.policy == "skip_step"  # the section's default: every rank skips


def test_a_bad_value_names_the_section(tmp_path):
    with pytest.raises(ConfigError, match=r"\[attnchecker\].*policy"):
        _converter(_job(tmp_path, "--attnchecker.policy", "ignore"))
    with pytest.raises(ConfigError, match=r"report_every"):
        converter.AttnChecker(report_every=-1).abft_config()


@pytest.mark.parametrize(
    ("args", "dims", "named"),
    [
        (("--activation_checkpoint.mode", "selective",
          "--activation_checkpoint.selective_ac_option", "op"), {},
         "op-level selective activation checkpointing"),
        (("--activation_checkpoint.mode", "full", "--compile.enable"), {},
         r"activation checkpointing \(full\) with per-block compile"),
        ((), {"cp": 2}, r"context parallelism \(cp = 2\)"),
        ((), {"pp": 2}, r"pipeline parallelism \(pp = 2\)"),
    ],
)  # fmt: skip
def test_what_it_cannot_protect_is_refused_by_name(tmp_path, args, dims, named):
    with pytest.raises(ConfigError, match=named):
        _converter(_job(tmp_path, *args), _dims(**dims))


def test_per_block_compile_on_the_route_equals_eager_and_does_not_recompile(tmp_path):
    """torchtitan's ``apply_compile`` (fullgraph=True per TransformerBlock; dynamo's "eager"
    backend here, to keep the test short) of the model the converter protected on the SDPA
    route, against the same protected model run without compile."""
    from torch._dynamo.utils import counters
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    def run(*args: str) -> tuple[list[float], list[int], list]:
        job = _job(tmp_path, "--attnchecker.backend", "sdpa", "--attnchecker.policy",
                   "skip_step", *args)  # fmt: skip
        model_args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                          vocab_size=128, max_seq_len=32)  # fmt: skip
        with torch.device("meta"):
            model = Transformer(model_args)
        conv = _converter(job)
        conv.convert(model)
        parallelize_llama(model, _dims(), job)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, graphs = [], []
        try:
            for step in range(4):
                detach = None
                if step == 3:  # a fault in a compiled block: corrected in its step

                    def nan(call) -> None:
                        call.tensor[0, 1, 2] = float("nan")

                    detach = conv.handle.attach(nan, sites=("q",), modules=(NAME,))
                x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(step))
                logits = model(x[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                if detach is not None:
                    detach.remove()
                opt.step()  # (rerouted through the guard at its first step)
                opt.zero_grad()
                conv.post_optimizer_hook(model)
                losses.append(float(loss))
                graphs.append(counters["stats"]["unique_graphs"])
            summary = conv.handle.summary()["per_module"][NAME]
            assert summary["engine"] == "sdpa"
            return losses, graphs, conv.events
        finally:
            conv.close()

    counters.clear()
    eager, _, eager_events = run()
    compiled, graphs, events = run("--compile.enable", "--compile.backend", "eager")
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for got in (eager_events, events):
        assert [(e["step"], e["module"], e["op"], e["action"]) for e in got] == [
            (4, NAME, "q", "corrected")]  # fmt: skip
    assert graphs[0] >= 2 and graphs[2] == graphs[0]  # one graph a block, no recompilation
    # (the injector's hook, attached at the fourth step, is a guard: a recompilation then)
