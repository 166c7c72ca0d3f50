"""What the grader writes: results.json (Gradescope format), a feedback page, grades.csv.

Every file is written atomically (a temporary file in the same folder, then
os.replace), so a reader never sees half a result, whatever happens to the grader.

results.json follows the Gradescope autograder specification::

    {"score": 7.0, "max_score": 8.0, "execution_time": 41.2, "output": "...",
     "tests": [{"name": ..., "score": ..., "max_score": ..., "status": "passed",
                "output": ...}, ...],
     "extra_data": {"passed": true, "pass_mark": 0.6, ...}}
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
from pathlib import Path

from labutils.runtime import runfiles

CSV_COLUMNS = ["submission", "score", "max_score", "percent", "passed", "notebook",
               "problems", "execution_time"]


WHEN_SHOWN = {"after_due_date": "shown after the due date",
              "after_published": "shown when the grades are published",
              "hidden": "never shown"}


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write the whole file or nothing, on disk before it is renamed: a grade must
    survive a crash of the grading machine."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    runfiles.write_atomic(path, data, sync=True)


def totals(tests: list[dict]) -> tuple[float, float]:
    return (round(sum(t["score"] for t in tests), 2), round(sum(t["max_score"] for t in tests), 2))


def required_failed(tests: list[dict]) -> list[str]:
    """The names of the required checks that did not pass (@check(required=True))."""
    return [t["name"] for t in tests if t.get("required") and t["status"] != "passed"]


def passes(tests: list[dict], pass_mark: float) -> bool:
    """At least the pass mark's share of the points, and every required check passed."""
    score, max_score = totals(tests)
    return (bool(max_score) and score >= pass_mark * max_score - 1e-9
            and not required_failed(tests))


def verdict(result: dict) -> str:
    """passed / below the pass mark / a required check failed (naming it)."""
    if result["passed"]:
        return "passed"
    failed = required_failed(result["tests"])
    if failed:
        return f"not passed: a required check failed ({'; '.join(failed)})"
    return "below the pass mark"


def gradescope_results(result: dict) -> dict:
    """The submission's result in the Gradescope autograder format."""
    score, max_score = totals(result["tests"])
    shown = [t for t in result["tests"] if t.get("visibility", "visible") == "visible"]
    held = [t for t in result["tests"] if t not in shown and t["max_score"]]
    if held:  # the output is visible at once: no total, no verdict that counts them
        seen, seen_max = totals(shown)
        lines = [f"{result['lab_title']}: {seen:g}/{seen_max:g} on the checks shown now; "
                 f"{len(held)} more check{'s' if len(held) > 1 else ''} worth "
                 f"{sum(t['max_score'] for t in held):g} points "
                 f"{'are' if len(held) > 1 else 'is'} graded too and shown later "
                 f"({'; '.join(sorted({WHEN_SHOWN[t['visibility']] for t in held}))})."]
    else:
        lines = [f"{result['lab_title']}: {score:g}/{max_score:g} ({verdict(result)}, pass mark "
                 f"{result['pass_mark']:.0%})."]
    meta = result.get("metadata") or {}
    if meta.get("names"):
        lines.append(f"Submitted by {', '.join(meta['names'])}"
                     + (" (late)." if meta.get("late") else "."))
    if result.get("grader_error"):
        lines.append(f"The grader could not grade this submission properly: {result['grader_error']}")
    if result.get("integrity"):
        lines.append("Changes to locked cells or lab files (undone before grading): "
                     + "; ".join(result["integrity"]))
    return {
        "score": score,
        "max_score": max_score,
        "execution_time": round(result.get("duration_s", 0.0), 2),
        "output": "\n".join(lines),
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": [{"name": t["name"], "score": t["score"], "max_score": t["max_score"],
                   "status": t["status"], "output": t.get("output", ""),
                   "visibility": t.get("visibility", "visible")}
                  for t in result["tests"]],
        "extra_data": {
            "submission": result["name"], "lab": result["lab"], "passed": result["passed"],
            "pass_mark": result["pass_mark"], "notebook": result.get("notebook", {}),
            "integrity": result.get("integrity", []), "sandbox": result.get("sandbox", {}),
            "runs": result.get("runs", []), "grader_error": result.get("grader_error", ""),
            **({"late": bool(meta.get("late")), "submitted_by": meta.get("names", [])}
               if meta else {}),
        },
    }


def feedback_page(result: dict) -> str:
    """A self-contained HTML page for the learner: score, each check, what was measured."""
    score, max_score = totals(result["tests"])
    ok = result["passed"]
    rows = []
    shown = [t for t in result["tests"] if t.get("visibility", "visible") == "visible"]
    held = [t for t in result["tests"] if t not in shown]
    for t in shown:
        passed = t["status"] == "passed"
        badge = ("#1a7f37", "passed") if passed else ("#cf222e", "failed")
        points = f"{t['score']:g} / {t['max_score']:g}" if t["max_score"] else "-"
        rows.append(
            f"<section><h3><span class='badge' style='background:{badge[0]}'>{badge[1]}</span> "
            f"{html.escape(t['name'])}{' (required to pass)' if t.get('required') else ''} "
            f"<span class='pts'>{points}</span></h3>"
            f"<pre>{html.escape(t.get('output', ''))}</pre></section>")
    notes = ""
    if result.get("grader_error"):
        notes += f"<p class='warn'>Grader problem: {html.escape(result['grader_error'])}</p>"
    sandbox = result.get("sandbox") or {}
    enforced = ", ".join(filter(None, [
        f"namespaces: {', '.join(sandbox.get('namespaces') or []) or 'none'}",
        f"network: {sandbox.get('network', 'not isolated')}",
        "limits: " + "; ".join(sandbox.get("limits", [])) if sandbox.get("limits") else "",
    ]))
    if held:
        seen, seen_max = totals(shown)
        later = sorted({WHEN_SHOWN[t.get("visibility")] for t in held})
        headline = (f"{seen:g} / {seen_max:g} on the checks shown here; {len(held)} more "
                    f"check{'s' if len(held) > 1 else ''} worth {sum(t['max_score'] for t in held):g} "
                    f"points {'are' if len(held) > 1 else 'is'} graded too")
        notes += (f"<p>The result of {len(held)} check{'s' if len(held) > 1 else ''} is not "
                  f"shown here ({html.escape('; '.join(later))}); your grade counts "
                  f"{'them' if len(held) > 1 else 'it'}.</p>")
    else:
        headline = (f"{score:g} / {max_score:g}: {html.escape(verdict(result))} "
                    f"({result['pass_mark']:.0%} needed)")
    executed = ("<p>Your notebook as the grader ran it: <a href='executed.ipynb'>executed.ipynb</a></p>"
                if result.get("has_executed_notebook") else "")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(result['lab_title'])}: feedback</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }}
.badge {{ color: white; border-radius: 8px; padding: 0 8px; font-size: 0.8em; }}
.pts {{ float: right; font-weight: normal; }}
pre {{ background: #f6f8fa; padding: 0.8em; white-space: pre-wrap; }}
.warn {{ color: #9a6700; }} .small {{ color: #6e7781; font-size: 0.85em; }}
</style></head><body>
<h1>{html.escape(result['lab_title'])}</h1>
<h2 style="color:{'#1a7f37' if ok or held else '#cf222e'}">{headline}</h2>
<p>Submission <b>{html.escape(result['name'])}</b>, graded in {result.get('duration_s', 0):.0f} s.
The checks ran your scripts for real in a separate process; nothing computed inside
your notebook counts towards the score.</p>
{notes}{executed}
{''.join(rows)}
<p class="small">Sandbox: {html.escape(enforced)}</p>
</body></html>
"""


def grades_csv(results: list[dict]) -> str:
    """One row per submission, in the order given."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in results:
        score, max_score = totals(r["tests"])
        problems = [t["name"] for t in r["tests"] if t["status"] != "passed" and t["max_score"]]
        if r.get("grader_error"):
            problems.insert(0, "grader error")
        writer.writerow([r["name"], f"{score:g}", f"{max_score:g}",
                         f"{100 * score / max_score:.1f}" if max_score else "0",
                         "yes" if r["passed"] else "no", r.get("notebook", {}).get("status", ""),
                         "; ".join(problems), f"{r.get('duration_s', 0):.1f}"])
    return out.getvalue()


GRADER_LOG = "grader.log"
LOG_TAIL_BYTES = 64 << 10


def grader_log(phase_logs: dict[str, str], supervisor_log: Path) -> bytes | None:
    """The end of what the notebook's kernel, the checks and the supervisor wrote to
    stderr, for the instructor (never in results.json or the feedback: the checks' own
    errors can quote hidden checks). None when all three were silent."""
    parts = []
    for name, path in [*phase_logs.items(), ("supervisor", str(supervisor_log))]:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - LOG_TAIL_BYTES))
                text = f.read()
        except OSError:
            continue
        if text.strip():
            cut = f" (its last {LOG_TAIL_BYTES >> 10} KiB of {size:,} bytes)" if size > LOG_TAIL_BYTES else ""
            parts.append(f"== {name}: stderr{cut}\n".encode() + text.rstrip(b"\n") + b"\n")
    return b"\n".join(parts) if parts else None


def write_submission(out_dir: Path, result: dict, executed_notebook: bytes | None,
                     log: bytes | None = None) -> None:
    """DIR/<name>/results.json, feedback.html and executed.ipynb, each atomically, and
    grader.log (the instructor's) where the sandboxed phases wrote to stderr."""
    folder = Path(out_dir) / result["name"]
    if executed_notebook is not None:
        write_atomic(folder / "executed.ipynb", executed_notebook)
    if log is not None:
        write_atomic(folder / GRADER_LOG, log)
    write_atomic(folder / "feedback.html", feedback_page(result))
    write_atomic(folder / "results.json", json.dumps(gradescope_results(result), indent=2))


def describe_outcome(outcome: dict, timeout: float) -> str:
    """What happened to the notebook, in a sentence or two for the learner."""
    status = outcome.get("status")
    where = outcome.get("cell", "a cell")
    took = f" in {outcome['duration_s']:.0f} s" if "duration_s" in outcome else ""
    if status == "completed":
        text = (f"The notebook ran to the end{took}. (Errors in cells tagged raises-exception "
                "are part of the story and do not count.)")
    elif status == "error":
        text = (f"The notebook stopped at {where}: {outcome.get('ename')}: {outcome.get('evalue')}. "
                "The cells after it did not run.")
    elif status == "timeout":
        text = (f"The notebook did not finish within {timeout:g} s (the limit is for the whole "
                f"notebook); it was running {where}.")
    elif status == "output_limit":
        text = f"The notebook printed far more output than the grader keeps; it was stopped at {where}."
    elif status == "kernel_died":
        text = (f"The kernel died (it was killed, crashed or ran out of memory) while running "
                f"{where}.")
    elif status in ("memory", "processes", "disk"):
        text = f"The notebook was stopped: it {outcome.get('detail')}."
    else:
        text = f"The notebook could not be run: {outcome.get('detail') or outcome.get('evalue') or status}."
    if outcome.get("output_bytes_dropped"):
        text += f" {outcome['output_bytes_dropped']} bytes of output were not kept."
    return text
