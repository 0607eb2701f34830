"""Reports: a typed Profile of a compiled Program, bottleneck analysis ("why"), HTML report and Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

from tremula.report.html import render_html, write_html
from tremula.report.profile import Profile, build_profile
from tremula.report.trace import write_trace
from tremula.report.why import explain

__all__ = ["Profile", "build_profile", "explain", "render_html", "report_paths", "write_html", "write_trace"]


def report_paths(result, chip, html: str | Path | None = None, trace: str | Path | None = None,
                 json_path: str | Path | None = None, model: str | None = None, exchanges=None) -> Profile:
    """One call for the CLI: profile a CompileResult and write whichever of the HTML report, the Chrome trace and the
    profile JSON were asked for. `chip` is a Chip;
    `exchanges` the program's scheduled timetables (timing.program_schedule.schedule_program), if any.
    Returns the Profile (its `to_json()` is what `--json` prints)."""
    profile = build_profile(result, chip, model=model, keep_tile_cycles=trace is not None or html is not None,
                            exchanges=exchanges)
    if html is not None:
        write_html(profile, html)
    if trace is not None:
        write_trace(profile, trace)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(profile.to_json(), indent=1, sort_keys=True))
    return profile
