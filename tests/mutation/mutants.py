"""The curated mutation run (issue 41 §4): one-line changes to the modules that carry the
promises of the README and docs/, each with the tests that must catch it.
``scripts/mutation.py`` applies each to a copy of ``src/`` and runs its tests there (``make
test-all``); a change the tests miss is a survivor, and the run fails on it unless the entry says
why it is equivalent (``equivalent``).
``tests/mutation/test_mutants.py`` (the default run) keeps this list applicable: each ``old``
occurs exactly once in its file, so a rewrite of a module fails it until the list follows.

Tests are named per module (``TESTS``) unless an entry names its own; ``-k`` expressions keep
the slow Triton-interpreter cases out (the eager reference is what these modules compute)."""

from __future__ import annotations

from typing import NamedTuple


class Mutant(NamedTuple):
    path: str  # under src/attnchecker/
    old: str  # occurs exactly once in the file
    new: str
    why: str  # what the change breaks (or, with ``equivalent``, why it cannot be seen)
    tests: tuple[str, ...] = ()  # pytest arguments; () = TESTS[the module]
    equivalent: str = ""  # a survivor argued equivalent: the run passes with it surviving


TESTS = {
    "abft/tolerance.py": ("tests/unit/abft/test_tolerance.py", "tests/unit/attention/test_tiny_rows.py",
                          "tests/unit/attention/test_checks.py", "tests/unit/abft/test_gemm.py",
                          "-k", "not triton"),
    "abft/gemm.py": ("tests/unit/abft/test_gemm.py", "-k", "not triton"),
    "attention/records.py": ("tests/unit/attention/test_records.py",
                             "tests/integration/test_protect_runtime.py"),
    "recovery/guard.py": ("tests/unit/recovery/test_guard.py", "tests/integration/test_guard.py"),
    "models/sdpa.py": ("tests/unit/models/test_sdpa_trace.py",
                       "tests/integration/test_protect_sdpa.py"),
    "adaptive/controller.py": ("tests/unit/adaptive", "tests/integration/test_adaptive.py"),
    "adaptive/validate.py": ("tests/unit/adaptive", "tests/integration/test_adaptive.py"),
    "recovery/replay.py": ("tests/integration/test_replay.py", "-k", "not compile"),
    "adaptive/price.py": ("tests/integration/test_pricing.py", "-k", "not validate"),
    "adaptive/price_check.py": ("tests/integration/test_pricing.py", "-k",
                                "judged_per_fault or naive or hidden or criterion"),
}  # fmt: skip

# fmt: off
MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ abft/tolerance.py
    Mutant("abft/tolerance.py", "return torch.finfo(dtype).eps / 2",
           "return torch.finfo(dtype).eps / 8", "every rounding bound four times too tight"),
    Mutant("abft/tolerance.py", "    factor = unit_roundoff(out_dtype) + 2 * (inner + length) *",
           "    factor = unit_roundoff(out_dtype) + 0 * (inner + length) *",
           "the accumulation term dropped: false alarms on long reductions"),
    Mutant("abft/tolerance.py", "        factor += 2 * _U_TF32  # both operands",
           "        factor += 0 * _U_TF32  # both operands",
           "fp32 GEMMs on TF32 tensor cores checked at IEEE fp32's bound"),
    Mutant("abft/tolerance.py", 'torch.get_float32_matmul_precision() != "highest"',
           'torch.get_float32_matmul_precision() == "highest"',
           "the precision's meaning inverted"),
    Mutant("abft/tolerance.py", "    ) + rounded * unit_roundoff(out.dtype)",
           "    ) + 0 * unit_roundoff(out.dtype)",
           "an autocast operand's rounding to the output dtype left out of the bound"),
    Mutant("abft/tolerance.py", "(length + 1) * (2 * inner + 1) * _TINY32",
           "(length + 1) * 1 * _TINY32",
           "the underflow floor of the products behind each element dropped"),
    Mutant("abft/tolerance.py", "    return computed + squares_lost(n)  # >=",
           "    return computed  # >=", "norms of tiny rows collapse: false alarms"),
    Mutant("abft/tolerance.py", "    factor = 4 * (inner + length) * unit_roundoff(torch.float32)",
           "    factor = 1 * (inner + length) * unit_roundoff(torch.float32)",
           "the fused kernels' bound without truncating matrix units",
           tests=("tests/unit/abft/test_tolerance.py",)),
    Mutant("abft/tolerance.py", "    per_product = 2 * _U32 + (_U32 if",
           "    per_product = 6 * _U32 + (_U32 if",
           "the accumulator GEMM's bound three times too wide: it sees 1e-4 of a row no more",
           tests=("tests/unit/kernels/test_acc_gemm.py", "-k", "1e_4")),
    Mutant("abft/tolerance.py", "    f_abs, f_mag = gemm_terms(out.dtype, out.device, inner=inner, length=length)",
           "    f_abs, f_mag = gemm_terms(out.dtype, out.device, inner=inner, length=length)\n"
           "    f_abs, f_mag = f_abs, f_mag + unit_roundoff(out.dtype)",
           "the core's scores and context bound charged the outputs' rounding on the magnitude "
           "again (the bound of before issue 55)",
           tests=("tests/unit/abft/test_tight_bounds.py", "-k", "core")),
    Mutant("attention/heads.py", "    wide = [half and t.element_size() > out.element_size() for t in ops]",
           "    wide = [False for t in ops]",
           "the core's references from autocast's fp32 operands, not the bf16 ones the GEMM "
           "multiplied: their rounding charged to the magnitude (~2-4% of a row)",
           tests=("tests/unit/abft/test_tight_bounds.py", "-k", "autocasts")),
    Mutant("attention/grads.py", "            ref = (xf @ ysum.unsqueeze(-1)).squeeze(-1)  # (..., M)",
           "            ref = (x @ ysum.unsqueeze(-1).to(x.dtype)).squeeze(-1).float()",
           "the core's backward reference back in the operands' dtype (bf16): 2 u of the "
           "magnitude in the residual, which the tight bound does not allow",
           tests=("tests/unit/abft/test_tight_bounds.py", "-k", "backward")),
    # ------------------------------------------------------------------ abft/gemm.py
    Mutant("abft/gemm.py", "a_r * scale, -math.sqrt(N) * f_r * scale,",
           "0.0, -math.sqrt(N) * f_r * scale,",
           "the outputs' own rounding (the row's L1 norm term) dropped: false alarms"),
    Mutant("attention/checks.py", "xf = round_as(x2, low).float()", "xf = x2.float()",
           "the projections' references from x unrounded (an fp32 input under autocast): a "
           "false alarm where a compiler elides .to(bf16).float()",
           tests=("tests/integration/test_protect_compile.py", "-k",
                  "bf16_autocast_with_backward_checks")),
    Mutant("abft/gemm.py", "*layout, min(max_rows, M), *lim)", "*layout, 1, *lim)",
           "the repair budget cut to one row"),
    Mutant("abft/gemm.py", "take = ~(top <= 0)[:, None]", "take = (top > 0)[:, None]",
           "a NaN row is not taken for repair (NaN > 0 is False)"),
    Mutant("abft/gemm.py", "torch.where(~(worst <= 0), new_col,", "torch.where(worst > 0, new_col,",
           "a NaN column is not repaired"),
    Mutant("abft/gemm.py", "again = (still.index_select(0, idx) & take.view(R)).any()",
           "again = still.any()", "lost rows beyond the budget reported as reproduced"),
    Mutant("abft/gemm.py", "return t.sum(dim, dtype=_F64).to(_F32)",
           "return t.sum(dim, dtype=torch.bfloat16).to(_F32)",
           "the references' sums rounded to bf16: false alarms at the tight bound"),
    Mutant("abft/gemm.py", "    rows = (~(exc_r <= 0)).sum(dtype=_F32)",
           "    rows = (exc_r > 0).sum(dtype=_F32)", "NaN rows not counted as flagged"),
    # ------------------------------------------------------------------ attention/records.py
    Mutant("attention/records.py", "    if first is not None:\n        same",
           "    if False:\n        same", "a checkpointing replay counted twice"),
    Mutant("attention/records.py", "(recs == first) | (recs.isnan() & first.isnan())",
           "(recs == first)", "a NaN record in both passes counted twice (NaN != NaN)"),
    Mutant("attention/records.py", "        det = det & ~same", "        det = det",
           "the replay's equal records kept"),
    Mutant("attention/records.py", "if not replay and not torch.compiler.is_compiling():",
           "if not torch.compiler.is_compiling():",
           "a replay overwrites the first pass it is compared with",
           equivalent="the replay's records differ from the first pass's only where they are "
           "counted, and the next first pass (the next step's forward) overwrites them before "
           "any other replay compares: checkpointing replays each segment once per backward"),
    Mutant("attention/records.py", "                sink.grad.zero_()", "                pass",
           "the backward's records not forgotten at a drain: counted again"),
    Mutant("attention/records.py", "self.log.index_add_(0, self._index(ops, recs.device), rows)",
           "self.log.index_copy_(0, self._index(ops, recs.device), rows)",
           "a second detection before the drain overwrites the first"),
    Mutant("attention/records.py", "rows = rows.masked_fill(same.all(1, keepdim=True), 0)",
           "rows = rows", "a replay's records equal to the first pass's counted twice, for the "
           "registered ops and the fused kernels",
           tests=("tests/integration/test_protect_runtime.py", "-k",
                  "replay_rule")),
    Mutant("attention/records.py", "        if not self.replayed and in_replay():\n",
           "        if False:\n", "the registered ops never learn that a replay reaches them: "
           "their replays counted twice",
           tests=("tests/integration/test_protect_runtime.py", "-k",
                  "replay_rule")),
    # ------------------------------------------------------------------ recovery/guard.py
    Mutant("recovery/guard.py", "op=torch.distributed.ReduceOp.MAX", "op=torch.distributed.ReduceOp.MIN",
           "one rank's flag does not skip the others: the replicas diverge"),
    Mutant("recovery/guard.py", "both = flag if theirs is None else torch.maximum(theirs, flag.to(theirs.device))",
           "both = flag", "under GradScaler a fused optimizer ignores the scaler's overflow"),
    Mutant("recovery/guard.py", 'and any(g.get("momentum", 0) for g in optimizer.param_groups)',
           "and False", "fused SGD's uninitialised momentum buffer after a skipped first step"),
    Mutant("recovery/guard.py", "                p.copy_(torch.where(skip, old, p))",
           "                pass", "a non-fused optimizer's parameters updated on a flagged step"),
    Mutant("recovery/guard.py", "                    new.copy_(torch.where(skip.to(new.device), old_v, new))",
           "                    pass", "a non-fused optimizer's state advanced on a flagged step"),
    Mutant("recovery/guard.py", "return (~torch.isfinite(torch.stack(parts).sum())).to(torch.float32)",
           "return torch.isnan(torch.stack(parts).sum()).to(torch.float32)", "an INF gradient not skipped"),
    Mutant("recovery/guard.py", "self.skipped = flag.clone() if self.skipped is None else self.skipped.add_(flag)",
           "self.skipped = flag.clone()", "skipped steps not counted beyond the last"),
    Mutant("recovery/guard.py", "if self._reads_first and self._first_step() and bool(flag):",
           "if self._reads_first and bool(flag):", "a host read of the flag on every step"),
    # ------------------------------------------------------------------ recovery/replay.py
    Mutant("recovery/replay.py", "        rng.restore()\n", "        pass\n",
           "the replay draws other dropout masks: not the fault-free step"),
    Mutant("recovery/replay.py", "            self.handle.rewind(mark)", "            pass",
           "the replay runs the next step's checks and reports the next step"),
    Mutant("recovery/replay.py", "            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)",
           "            pass", "one rank replays alone"),
    Mutant("recovery/replay.py", "        reproduced = lost_again or bad_again", "        reproduced = lost_again",
           "a non-finite replay applied"),
    Mutant("recovery/replay.py", "        elif bad_again and not lost_again and self.scaler is not None:",
           "        elif bad_again and self.scaler is not None:",
           "a reproduced uncorrectable error handed to the scaler, which backs its scale off"),
    Mutant("recovery/replay.py", "        return TRANSIENT, (", "        return PERSISTENT, (",
           "a clean replay called persistent"),
    # ------------------------------------------------------------------ adaptive/price.py
    Mutant("adaptive/price.py", "            r = torch.where(gain > 0, dearer / gain.clamp_min(1e-300), math.inf)",
           "            r = torch.where(gain > 0, 0.5 * dearer / gain.clamp_min(1e-300), math.inf)",
           "the crossover stated where the lines do not meet"),
    Mutant("adaptive/price.py", '"silent_deviation": sdc, "non_trainable": self.restart_steps}',
           '"silent_deviation": 0.0, "non_trainable": self.restart_steps}',
           "silent deviations priced at nothing"),
    Mutant("adaptive/price.py", "        return rate.value * self.devices * self.step_seconds / (3600 * hours)",
           "        return rate.value * self.step_seconds / (3600 * hours)",
           "a rate per device taken for the whole job"),
    Mutant("adaptive/price.py", "            onehots[m.name] = f * onehots[\"protected_replay\"] + (1 - f) * onehots[\"guard_replay\"]",
           "            onehots[m.name] = onehots[\"protected_replay\"]",
           "a plan credited with every site, checked or not"),
    Mutant("adaptive/price.py", "    best = min(priced, key=lambda p: p.lost.point).option.name",
           "    best = min(priced, key=lambda p: p.per_fault.point).option.name",
           "the overhead left out of the choice"),
    # ------------------------------------------------------------------ adaptive/price_check.py
    Mutant("adaptive/price_check.py", "        mine = FaultPlan(tuple(f for f in sampled.faults if f.step == at) if with_faults else ())",
           "        mine = FaultPlan(())", "the faulty fork runs without its faults: nothing deviates"),
    Mutant("adaptive/price_check.py", "        if lost:  # skipped or non-trainable: counted above, not a silent deviation",
           "        if False:", "a non-finite or skipped fork counted as a silent deviation"),
    Mutant("adaptive/price_check.py", "        rng.restore()\n", "        pass\n",
           "the forks draw other dropout masks: every fault deviates"),
    Mutant("adaptive/price_check.py", "    return departed(list(zip(losses, clean_losses, strict=True)), drift, LOSS_TOL, lr)",
           "    return departed(list(zip(losses, clean_losses, strict=True)), 0.0, LOSS_TOL, lr)",
           "a deviation seen in the parameters only is missed"),
    Mutant("adaptive/price_check.py", "        gains = tuple(Gain(r.option, tuple(b - a for a, b in",
           "        gains = tuple(Gain(r.option, tuple(a - b for a, b in",
           "the schedule's gain stated with its sign turned"),
    # ------------------------------------------------------------------ models/sdpa.py
    Mutant("models/sdpa.py", "PROBE_ULPS = 64", "PROBE_ULPS = 100_000",
           "the probe lets a misread scale through"),
    Mutant("models/sdpa.py", "if not bool(same_nan.all()) or worst > tol:", "if worst > tol:",
           "a NaN-only mismatch passes the probe"),
    Mutant("models/sdpa.py", "    if differ := probe(found.calls):", "    if differ := []:",
           "the probe's refusal unwired from protect_"),
    Mutant("models/sdpa.py", "return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale",
           "return 1.0 / math.sqrt(query.shape[-1])", "an explicit scale ignored"),
    Mutant("models/sdpa.py", "    if refused and (strict or not found.sdpa):",
           "    if refused and not found.sdpa:", "strict=True leaves unrouted attention unchecked"),
    Mutant("models/sdpa.py", "    if found.unseen:  # named", "    if False:  # named",
           "modules naming another attention function that ran unseen: no warning"),
    Mutant("models/sdpa.py", "    if attn_mask is not None and is_causal:\n        raise",
           "    if False:\n        raise", "a mask with is_causal accepted: the core drops the mask"),
    # ------------------------------------------------------------------ adaptive/controller.py
    Mutant("adaptive/controller.py", "        if m.high <= budget:\n            return choice",
           "        if m.point <= budget:\n            return choice",
           "plan --verify accepts on the point, not the upper end"),
    Mutant("adaptive/controller.py", "        b = min(b, choice.overhead.high) * budget / m.high",
           "        b *= 0.9", "a fixed back-off instead of the measured one"),
    Mutant("adaptive/controller.py", "cheapest = min(cost.engine.high + _least(ss, core),",
           "cheapest = min(cost.engine.point + _least(ss, core),",
           "a budget below the engine's upper end accepted"),
    Mutant("adaptive/controller.py", "options.append(greedy.for_budget(budget - cost.engine.high))",
           "options.append(greedy.for_budget(budget))", "the engine's cost not charged to the budget"),
    Mutant("adaptive/controller.py", "    e = engine if _core(ss, f) else Estimate(0.0, 0.0, 0.0)",
           "    e = engine", "the engine charged to a schedule without a core check"),
    Mutant("adaptive/controller.py", '    end = {"point": 0, "high": 2}[estimate]',
           '    end = {"point": 0, "high": 0}[estimate]', "a target judged on the point risk"),
    # ------------------------------------------------------------------ adaptive/validate.py
    Mutant("adaptive/validate.py", "alphas.setdefault(post, [n + 0.5 for n in counts])",
           "alphas.setdefault(post, [(n + 0.5) * 20 for n in counts])",
           "the posterior twenty times overconfident"),
    Mutant("adaptive/validate.py", "and self.checks and self.overhead.high > self.budget:",
           "and self.checks and self.overhead.point > self.budget:",
           "a budget judged by the median, not the upper end"),
    Mutant("adaptive/validate.py", "    return p < alpha\n", "    return p < alpha / 10\n",
           "the binomial test at 0.5%"),
    Mutant("adaptive/validate.py", "low = torch.quantile(counts, (1 - level) / 2,",
           "low = torch.quantile(counts, (1 - level),", "an interval of level 85%, not 90%"),
    Mutant("adaptive/validate.py", "        counts = torch.poisson(mu)", "        counts = mu.round()",
           "the Poisson noise of a run's count dropped from the interval"),
    Mutant("adaptive/validate.py", "fit_measured(vuln, cost, rate, b, timed) if verify else choose(",
           "fit_measured(vuln, cost, rate, b, timed) if False else choose(",
           "validate --verify validates the unverified choice"),
    Mutant("adaptive/validate.py", "        lo, hi = (mid, hi) if seen[mid] <= target else (lo, mid)",
           "        lo, hi = (lo, mid) if seen[mid] <= target else (mid, hi)",
           "the baselines' bisection inverted"),
    Mutant("adaptive/validate.py", "        half = _T975.get(len(d) - 1, 1.96) * sd / math.sqrt(len(d))",
           "        half = 1.96 * sd / math.sqrt(len(d))", "the gains' interval too narrow for 5 seeds"),
    # ------------------------------------------------------- tensor parallel, torchtitan
    Mutant("attention/sharded.py", "        grad_x = (Partial(),)  # each rank's dX is a partial sum",
           "        grad_x = (Replicate(),)  # each rank's dX is a partial sum",
           "a column-split layer's dX taken as whole on each rank: not summed over the ranks",
           tests=("tests/integration/test_torchtitan_parallel.py",)),
    Mutant("integrations/torchtitan.py", "                self._reroute(o)\n",
           "                pass\n",
           "torchtitan's optimizers left unguarded: an uncorrectable step is taken",
           tests=("tests/integration/test_torchtitan_parallel.py",)),
)
# fmt: on
