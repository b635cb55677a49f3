"""Every relative link and #anchor in README.md, BENCHMARKS.md and docs/*.md must resolve, anchors as GitHub
makes them from headings. `.ci/run` runs it; by hand: `python3 docs/check_links.py [ROOT]` (exit 1 if broken)."""
import re, sys, pathlib
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent).resolve()
files = [root / "README.md", root / "BENCHMARKS.md"] + sorted((root / "docs").glob("*.md"))

def strip_code(text):
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence; out.append(""); continue
        out.append("" if fence else line)
    return out

def slugs(path):
    seen, result = {}, set()
    for line in strip_code(path.read_text()):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m: continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0); seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result

bad = 0; count = 0
for f in files:
    for i, line in enumerate(strip_code(f.read_text()), 1):
        line = re.sub(r"`[^`]*`", "", line)
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target): continue
            count += 1
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                print(f"{f.relative_to(root)}:{i}: missing file {target}"); bad += 1; continue
            if anchor and (dest.suffix != ".md" or anchor not in slugs(dest)):
                print(f"{f.relative_to(root)}:{i}: missing anchor {target}"); bad += 1
print(f"{count} relative links checked, {bad} broken")
sys.exit(1 if bad else 0)
