"""The control before blame: reproduce a divergence with no KV transfer at all.

A pass that diverges from the baseline while every digest matches proves only that
the tokens differ, not that the KV path is wrong: an engine that is not invariant to
a prefix hit or to the batch diverges the same way with no transfer at all. So each
such request is run again on the colocated reference server (the same engine and
model, no PD), in two cache states:

    baseline state   flushed, then the prefix the baseline found cached warmed first
    run state        flushed, then the prefix the diverging run found cached warmed
                     first; for a concurrent pass with the same cached prefix, the
                     pass's whole batch replayed at its concurrency instead

and the classification follows from what the control gives:

    control in the baseline state != baseline   inconclusive: the reference is not
                                                comparable; the finding blames nothing
    control found other cached tokens           inconclusive too: it did not reach the
      than the baseline or the run              state it stands in for
    control in the run state == baseline        divergence: only PD diverges there
    control in the run state != baseline        engine-numerics: the engine diverges
                                                with no transfer (the same way when it
                                                gives the run's tokens)

The reference pass needs no control: it is the run without transfer. Requests whose
digests differ are kv-corruption already and are not controlled.
"""

from __future__ import annotations

from dataclasses import replace

from pdctl.errors import LaunchError
from pdctl.verify.client import Result, flush
from pdctl.verify.diagnose import Finding
from pdctl.verify.passes import Context, PassResult
from pdctl.verify.targets import NoReference
from pdctl.verify.workload import Prompt

CONTROLLED = ("unconfirmed", "near-tie")
MODE_HINT = "serving.deterministic: true (fixed-order kernels) removes it"


def apply_controls(ctx: Context) -> None:
    """Control every unconfirmed divergence and near-tie; reclassify what it shows."""
    pending = [f for f in ctx.findings if f.classification in CONTROLLED]
    if not pending or not ctx.passes:
        return
    baseline = {r.prompt.id: r for r in ctx.passes[0].results}
    runs = {p.name: p for p in ctx.passes}
    controller = _Controller(ctx)
    for finding in pending:
        if finding.pass_name == "reference":
            _reference_is_its_own_control(finding)
            continue
        run = runs.get(finding.pass_name)
        answers = {r.prompt.id: r for r in run.results} if run is not None else {}
        base, answer = baseline.get(finding.request), answers.get(finding.request)
        if run is not None and base is not None and answer is not None:
            controller.control(finding, base, answer, run)


class _Controller:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.url: str | None = None
        self.unavailable: str | None = None
        self.replays: dict[str, dict[str, Result]] = {}  # pass -> its batch, replayed

    def _reference(self) -> str | None:
        if self.url is None and self.unavailable is None:
            try:
                self.url = self.ctx.target.reference()
            except (NoReference, LaunchError) as why:
                self.unavailable = str(why).splitlines()[0]
        return self.url

    def control(self, finding: Finding, base: Result, run: Result, run_pass: PassResult) -> None:
        url = self._reference()
        if url is None:
            finding.message += f"; no control could run ({self.unavailable}): nothing is blamed"
            finding.evidence["control"] = {"ran": False, "reason": self.unavailable}
            return
        in_base = self._in_state(url, base.prompt, base.cached_tokens)
        if run_pass.name == "concurrent" and run.cached_tokens == base.cached_tokens:
            state = f"the concurrent batch replayed at concurrency {self.ctx.settings.concurrency}"
            in_run = self._replay(url, run_pass)[run.prompt.id]
        else:
            state = _state(run.cached_tokens)
            in_run = self._in_state(url, run.prompt, run.cached_tokens)
        finding.evidence["control"] = {
            "ran": True,
            "server": url,
            "baseline_state": _state(base.cached_tokens),
            "baseline_state_output_ids": in_base.output_ids,
            "run_state": state,
            "output_ids": in_run.output_ids,
            "cached_tokens": in_run.cached_tokens,
            "error": in_base.error or in_run.error,
        }
        _classify(finding, base, run, in_base, in_run, self.ctx.settings.deterministic)

    def _in_state(self, url: str, prompt: Prompt, cached: int) -> Result:
        """`prompt` on the reference after a flush, with its first `cached` tokens warmed."""
        flush(self.ctx.client, [url])
        if cached > 0:
            warm = prompt
            if prompt.input_ids is not None and not prompt.images:
                warm = replace(prompt, id=f"{prompt.id}-warm", input_ids=prompt.input_ids[:cached])
            self.ctx.send(url, warm, max_new_tokens=1)
        return self.ctx.send(url, prompt)

    def _replay(self, url: str, run_pass: PassResult) -> dict[str, Result]:
        if run_pass.name not in self.replays:
            flush(self.ctx.client, [url])
            prompts = [r.prompt for r in run_pass.results]
            results = self.ctx.send_all(url, prompts)
            self.replays[run_pass.name] = {r.prompt.id: r for r in results}
        return self.replays[run_pass.name]


def _state(cached: int) -> str:
    return f"{cached} prompt tokens cached" if cached > 0 else "cold (nothing cached)"


def _classify(
    finding: Finding,
    base: Result,
    run: Result,
    in_base: Result,
    in_run: Result,
    deterministic: bool,
) -> None:
    why = _inconclusive(base, run, in_base, in_run)
    if why is not None:
        finding.message += f"; the control is inconclusive ({why}): nothing is blamed"
        return
    if in_run.output_ids == base.output_ids:
        if finding.classification == "unconfirmed":
            _blame_pd(
                finding,
                "the colocated control, moving no KV, gives the baseline's tokens in the same "
                "cache state, so the KV or its transfer is wrong",
            )
        else:
            finding.message += "; the control without KV transfer gives the baseline's tokens"
        return
    same = "the same way" if in_run.output_ids == run.output_ids else "too (other tokens)"
    finding.classification = "engine-numerics"
    head = finding.message.split(";", 1)[0]
    finding.message = (
        f"{head}; engine numerics, not PD: the colocated control, moving no KV, diverges "
        f"{same} in the same cache state ({finding.evidence['control']['run_state']}); "
        + (
            "deterministic serving is on, so the engine broke its invariance (an engine bug)"
            if deterministic
            else f"reported, not failed ({MODE_HINT})"
        )
    )


def _inconclusive(base: Result, run: Result, in_base: Result, in_run: Result) -> str | None:
    """Why the control says nothing, if it does not: it failed, it did not reach the same
    cache state, or the reference disagrees with the baseline in its own state."""
    if not (in_base.ok and in_run.ok):
        return in_base.error or in_run.error or "the control's request failed"
    for what, wanted, got in (("baseline", base, in_base), ("diverging run", run, in_run)):
        if got.cached_tokens != wanted.cached_tokens:
            return (
                f"in the {what}'s state it found {got.cached_tokens} cached tokens, "
                f"the {what} {wanted.cached_tokens}"
            )
    if in_base.output_ids != base.output_ids:
        return (
            f"in the baseline's own cache state it gives {in_base.output_ids[:8]}..., not the "
            "baseline's tokens"
        )
    return None


def _reference_is_its_own_control(finding: Finding) -> None:
    if finding.classification == "unconfirmed":
        _blame_pd(
            finding,
            "the colocated reference moves no KV and gives other tokens in the same cache "
            "state, so PD (the KV path or the TP split) is wrong",
        )


def _blame_pd(finding: Finding, evidence: str) -> None:
    """An unconfirmed finding the control does not reproduce: a divergence, with why."""
    finding.classification = "divergence"
    finding.message = finding.message.replace(
        ", not reproduced without KV transfer", f": {evidence}"
    )
