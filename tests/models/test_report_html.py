"""The HTML report of a tiny model renders in headless Chromium with no console errors and with non-empty plots.

A copy of the report gets a small probe script (the report itself has no scripts): after load it records every image's
natural size and how many of its pixels are not background, plus any error raised on the page, into the DOM, which
Chromium's --dump-dom prints. Skips with a reason when Chromium is not installed (CI: apt-get install -y chromium).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.report import build_profile, write_html
from tremula.target.chip import load_chip
from tremula.timing.program_schedule import schedule_program

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p and Path(p).exists()), None)

PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.type)), true);
const origError = console.error;
console.error = (...a) => { window.__errors.push(a.join(' ')); origError(...a); };
window.addEventListener('load', () => {
  const imgs = Array.from(document.images).map(img => {
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const ctx = c.getContext('2d');
    let inked = 0;
    if (c.width && c.height) {
      ctx.drawImage(img, 0, 0);
      const d = ctx.getImageData(0, 0, c.width, c.height).data;
      for (let i = 0; i < d.length; i += 4) if (d[i] < 200 || d[i + 1] < 200 || d[i + 2] < 200) inked++;
    }
    return {alt: img.alt, w: img.naturalWidth, h: img.naturalHeight, inked: inked, complete: img.complete};
  });
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({imgs: imgs, errors: window.__errors,
                                    sections: Array.from(document.querySelectorAll('h2')).map(h => h.id),
                                    tables: document.querySelectorAll('table').length});
  document.body.appendChild(out);
});
</script>"""


def _chromium(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *extra, url],
        capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_report_renders_in_chromium(tmp_path):
    if CHROMIUM is None:
        pytest.skip("Chromium not installed (/usr/bin/chromium); install it with `apt-get install -y chromium`")
    chip = load_chip("mk2")
    graph = load_model("vit-tiny", batch=2)
    res = compile_model(graph, chip, batch=2, dtype="fp16")
    exchanges = schedule_program(res.program, chip)  # the steps table then shows makespans against bounds
    report = write_html(build_profile(res, chip, exchanges=exchanges), tmp_path / "report.html")
    text = report.read_text()
    assert "<script" not in text and not re.search(r"(src|href)=\"(https?:)?//", text)  # self-contained
    assert "exchange makespan" in text and "makespan / bound" in text and 'id="exchange-code"' in text
    probed = tmp_path / "probed.html"
    probed.write_text(text.replace("</body>", PROBE + "</body>"))

    run = _chromium(probed.as_uri(), tmp_path, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.DOTALL)
    assert m, "probe did not run: " + run.stdout[-500:]
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                       .replace("&gt;", ">"))
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert probe["errors"] == [] and console == [], (probe["errors"], console)
    assert {"summary", "why", "bsp", "cycles", "ops", "memory", "liveness", "steps"} <= set(probe["sections"])
    assert probe["tables"] >= 3
    imgs = {i["alt"]: i for i in probe["imgs"]}
    assert set(imgs) == {"BSP trace", "cycles by op", "memory per tile", "liveness per step"}
    for alt, i in imgs.items():
        assert i["complete"] and i["w"] > 300 and i["h"] > 100, (alt, i)
        # A drawn plot has axes, labels and data: well over 1% of its pixels are not background.
        assert i["inked"] > 0.01 * i["w"] * i["h"], (alt, i)

    shot = tmp_path / "shot.png"
    run = _chromium(report.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    assert run.returncode == 0 and shot.stat().st_size > 10_000
