"""The properties of tests/test_random_models.py on many more random models.

    python -m benchmarks.random_models                    # 500 generic + 500 transformers models
    python -m benchmarks.random_models --examples 100 --only hf --seed 3

Each example: a configuration drawn by tests/generic.py's hypothesis strategies and tp in {2, 4};
the model is sharded in simulation and must either be refused with an AutotpError before
running, or give the unsharded model's logits, loss and gradients (fp32, 1e-4) on an input of
another batch and sequence size than the traced example. A refused example is tried again with
strict=False (replicating what strict refuses), which must then match too or be refused again.

Prints a line per example, then per property the counts (matched / refused, grouped by the
first line of the message / FAILED), the largest differences seen and every failing
configuration in full. Exits 1 if any example FAILED.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import Stopwatch

DIFFS = ["output_diff", "loss_diff", "grad_diff", "grad_rel"]


@dataclass
class Tally:
    name: str
    examples: int = 0
    matched: int = 0
    refused: Counter = field(default_factory=Counter)
    failed: list = field(default_factory=list)  # (tp, config, what)
    retry_matched: int = 0
    retry_refused: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)  # unused parameters left out
    max_diff: dict = field(default_factory=lambda: {k: (0.0, "") for k in DIFFS})
    sharded: list = field(default_factory=list)  # fraction of parameter elements sharded
    seconds: float = 0.0
    # per option tag of generic.features: examples, matched, refused (per message), FAILED
    by_feature: dict = field(default_factory=dict)

    def record_diffs(self, outcome: Any, label: str) -> None:
        self.sharded.append(outcome.sharded)
        for key in DIFFS:
            value = getattr(outcome, key)
            if value >= self.max_diff[key][0]:
                self.max_diff[key] = (value, label)

    def record_feature(self, tags: list[str], failed: bool, refused: str | None) -> None:
        """One example's outcome under each of its option tags; an example refused and then
        FAILED with strict=False counts as FAILED."""
        for tag in tags:
            entry = self.by_feature.setdefault(tag, {"examples": 0, "matched": 0, "failed": 0,
                                                     "refused": Counter()})
            entry["examples"] += 1
            if failed:
                entry["failed"] += 1
            elif refused is not None:
                entry["refused"][refused] += 1
            else:
                entry["matched"] += 1


SEQUENCE_PARALLEL = [False]  # set from the command line


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "(empty message)"


def run_one(tally: Tally, config: Any, tp: int) -> str:
    """One example; returns its one-line status."""
    from tests.generic import check_equivalence, describe

    def attempt(strict: bool) -> Any:
        try:
            return check_equivalence(config, tp, strict=strict,
                                     sequence_parallel=SEQUENCE_PARALLEL[0])
        except Exception as e:  # anything but an AutotpError (returned as refused) fails
            tally.failed.append((tp, describe(config), f"strict={strict}: {type(e).__name__}: "
                                 f"{e}\n{traceback.format_exc(limit=-6)}"))
            return None

    outcome = attempt(strict=True)
    if outcome is None:
        return "FAILED (exception)"
    if outcome.dropped:
        tally.dropped[", ".join(outcome.dropped)] += 1
    if outcome.refused is None:
        tally.record_diffs(outcome, f"tp={tp} {describe(config)}")
        if outcome.ok:
            tally.matched += 1
            return (f"matched  logits {outcome.output_diff:.1e} grad {outcome.grad_diff:.1e} "
                    f"sharded {outcome.sharded:.0%}")
        tally.failed.append((tp, describe(config), _diffs(outcome)))
        return "FAILED " + _diffs(outcome)
    reason = _first_line(outcome.refused)
    tally.refused[reason] += 1
    retry = attempt(strict=False)
    if retry is None:
        return f"refused ({reason[:60]}); strict=False FAILED (exception)"
    if retry.refused is not None:
        tally.retry_refused[_first_line(retry.refused)] += 1
        return f"refused ({reason[:60]}); strict=False refused too"
    tally.record_diffs(retry, f"tp={tp} strict=False {describe(config)}")
    if retry.ok:
        tally.retry_matched += 1
        return f"refused ({reason[:60]}); strict=False matched"
    tally.failed.append((tp, describe(config), "strict=False: " + _diffs(retry)))
    return f"refused ({reason[:60]}); strict=False FAILED " + _diffs(retry)


def _diffs(o: Any) -> str:
    return (f"logits {o.output_diff:.3e}, loss {o.loss_diff:.3e}, grad {o.grad_diff:.3e} "
            f"({o.grad_rel:.3e} relative, worst {o.worst_param})")


def run_property(name: str, strategy: Any, examples: int, seed: int) -> Tally:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    tally = Tally(name)
    run_clock = Stopwatch()

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(config=strategy, tp=st.sampled_from([2, 4]))
    def prop(config: Any, tp: int) -> None:
        from tests.generic import features

        clock = Stopwatch()
        failed, refused = len(tally.failed), Counter(tally.refused)
        status = run_one(tally, config, tp)
        reason = next(iter(tally.refused - refused), None)  # the message it was refused with
        tally.record_feature(features(config), len(tally.failed) > failed, reason)
        tally.examples += 1
        print(f"[{name} {tally.examples:>4}/{examples}] tp={tp} {clock.seconds:5.1f}s "
              f"{status}", flush=True)

    prop()
    tally.seconds = run_clock.seconds
    return tally


def summary(tally: Tally) -> str:
    lines = [f"== {tally.name}: {tally.examples} examples in {tally.seconds:.0f} s "
             f"({tally.seconds / max(tally.examples, 1):.2f} s each)",
             f"  matched: {tally.matched}",
             f"  refused with AutotpError: {sum(tally.refused.values())}"]
    for reason, n in tally.refused.most_common():
        lines.append(f"    {n:>4}  {reason}")
    lines.append(f"  refused examples retried with strict=False: matched {tally.retry_matched}, "
                 f"refused again {sum(tally.retry_refused.values())}")
    for reason, n in tally.retry_refused.most_common():
        lines.append(f"    {n:>4}  {reason}")
    lines.append(f"  FAILED: {len(tally.failed)}")
    if tally.sharded:
        fractions = sorted(tally.sharded)
        lines.append(f"  parameter elements sharded, over all that ran: min {fractions[0]:.0%}, "
                     f"median {fractions[len(fractions) // 2]:.0%}, nothing sharded in "
                     f"{sum(f == 0 for f in fractions)}")
    lines.append("  max diffs over all that ran (autotp.verification.verify.compare's):")
    for key, (value, label) in tally.max_diff.items():
        lines.append(f"    {key:<12} {value:.3e}  {label}")
    if tally.by_feature:
        lines.append("  per option (examples: matched / refused / FAILED):")
        for tag, entry in sorted(tally.by_feature.items()):
            lines.append(f"    {tag:<36} {entry['examples']:>4}: {entry['matched']} / "
                         f"{sum(entry['refused'].values())} / {entry['failed']}")
            for reason, n in entry["refused"].most_common():
                lines.append(f"      {n:>4}  refused: {reason}")
    if tally.dropped:
        lines.append("  unused parameters absent from the sharded module (not failures):")
        for names, n in tally.dropped.most_common():
            lines.append(f"    {n:>4}  {names}")
    for tp, config, what in tally.failed:
        lines.append(f"  FAILED tp={tp} {config}\n    {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="examples per property")
    parser.add_argument("--only", choices=["generic", "hf"], help="one property only")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="plan with sequence parallelism (sequence length 12)")
    args = parser.parse_args(argv)
    SEQUENCE_PARALLEL[0] = args.sequence_parallel
    # strict=False records what it replicates as a UserWarning per example: not news here
    warnings.filterwarnings("ignore", message="autotp:")

    from tests.generic import generic_configs, hf_configs

    properties = [("generic", generic_configs()), ("hf", hf_configs())]
    tallies = [run_property(name, strategy, args.examples, args.seed)
               for name, strategy in properties if args.only in (None, name)]
    print()
    for tally in tallies:
        print(summary(tally))
    failed = sum(len(t.failed) for t in tallies)
    print(f"\n{'FAILED: ' + str(failed) if failed else 'no failures'} in "
          f"{sum(t.examples for t in tallies)} examples")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
