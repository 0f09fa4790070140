"""Prints a pipeline timeline (`host timeline --out-dir D`, D/timeline.json)
chunk by chunk: each H2D's span and the gap since the previous one, the time
from the H2D's end to the kernel's end, and each D2H's end with the time it
added (since the later of its kernel's end and the previous D2H's end).

    python3 bench/tl.py out/timeline.json [more.json ...]

The events are timed ones, which cost a few microseconds per chunk: the
totals are longer than an untimed run's."""
import json, sys
for p in sys.argv[1:]:
    d = json.load(open(p))
    rows = d["chunks"]
    print(p, d["plan"])
    prev_h2d_end = None
    prev_d2h_end = None
    for r in rows:
        t = r["t"]
        gap = (t[0] - prev_h2d_end) * 1e3 if prev_h2d_end is not None else 0
        print(f"  c{r['chunk']:>2} h2d {t[0]*1e3:7.1f}-{t[1]*1e3:7.1f} ({(t[1]-t[0])*1e3:5.1f}) gap {gap:5.1f} | k end {t[2]*1e3:7.1f} ({(t[2]-t[1])*1e3:5.1f}) | d2h end {t[3]*1e3:7.1f} (+{(t[3]-max(t[2], prev_d2h_end or 0))*1e3:5.1f})")
        prev_h2d_end = t[1]; prev_d2h_end = t[3]
