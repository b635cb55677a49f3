"""The /status page in a real browser: Debian's Chromium, headless, during a fault.

The plugin runs on the fake NVML (node.py); GPU 1 gets an XID 79 and GPU 3 is fenced with the plugin's own
`fence` command. Once /status says so, Chromium loads http://127.0.0.1:<port>/status as a user would (it sends
its own `Accept: text/html,...`). What it renders must show: a table per GPU with its index and UUID, GPU 1
Unhealthy with the XID 79 message and its condition, GPU 3 fenced with who did it and why, GPU 0 Healthy (and
any other client still gets the JSON, the `status` command its table). Its
screenshot must show the health in colour (the page's red and green badges are in it), and is written where
asked (docs/status-page.png is one).

Usage: python3 browser_test.py [--screenshot PATH] [CHROMIUM]   (default: chromium on PATH)
"""

import html.parser
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

import node
from node import Failure, gpu

# The page's badge colours (src/http/page.rs): Unhealthy, Healthy.
RED = (0xC0, 0x26, 0x2D)
GREEN = (0x1E, 0x7B, 0x34)
WINDOW = "1280,1500"


class Text(html.parser.HTMLParser):
    """The text a page shows, per table: caption -> [cell texts], and all of it."""

    def __init__(self):
        super().__init__()
        self.depth = 0
        self.tables = {}
        self.current = None
        self.cell = None
        self.in_caption = False
        self.caption = ""
        self.skip = 0
        self.all = []

    def handle_starttag(self, tag, attrs):
        if tag in ("style", "script"):
            self.skip += 1
        if tag == "table":
            self.depth += 1
        if tag == "caption" and self.depth == 1:
            self.in_caption, self.caption = True, ""
        if tag in ("td", "th") and self.depth == 1:
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("style", "script"):
            self.skip -= 1
        if tag == "caption" and self.in_caption:
            self.in_caption = False
            self.current = " ".join(self.caption.split())
            self.tables[self.current] = []
        if tag in ("td", "th") and self.depth == 1 and self.cell is not None and self.current:
            self.tables[self.current].append(" ".join(self.cell.split()))
            self.cell = None
        if tag == "table":
            self.depth -= 1

    def handle_data(self, data):
        if self.skip:
            return
        self.all.append(data)
        if self.in_caption:
            self.caption += data
        # A nested table's cells (conditions, fences) are part of the outer cell's text.
        if self.cell is not None:
            self.cell += " " + data


def chromium(binary, *args):
    profile = tempfile.mkdtemp(prefix="gdp-chromium-")
    try:
        done = subprocess.run(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--user-data-dir=" + profile, *args],
            capture_output=True, text=True, timeout=90)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if done.returncode != 0:
        raise Failure("chromium %s failed: %s" % (" ".join(args), done.stderr[-2000:]))
    return done.stdout


def pixels(path):
    """The RGB pixels of a PNG (8-bit RGB or RGBA, not interlaced, as Chromium writes its screenshots)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise Failure("%s is not a PNG" % path)
    at, chunks, header = 8, [], None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        raise Failure("unexpected PNG format %s" % (header,))
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * bpp
    rows, previous, at = [], bytearray(stride), 0
    for _ in range(height):
        kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
        at += 1 + stride
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = previous[i]
            corner = previous[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(line)
        previous = line
    counts = {}
    for line in rows:
        for i in range(0, stride, bpp):
            rgb = (line[i], line[i + 1], line[i + 2])
            counts[rgb] = counts.get(rgb, 0) + 1
    return (width, height), counts


def expect(cells, *wanted, where):
    text = " | ".join(cells)
    for want in wanted:
        if want not in text:
            raise Failure("%s does not show %r; it shows: %s" % (where, want, text))


def run():
    args = sys.argv[1:]
    screenshot = None
    if args[:1] == ["--screenshot"]:
        screenshot, args = os.path.abspath(args[1]), args[2:]
    binary = args[0] if args else "chromium"
    with node.Node() as n:
        n.inject("xid %s 79" % gpu(1))
        n.command("fence", gpu(3), "--reason", "burn-in failed")
        n.scrape_when("GPU 1 Unhealthy and GPU 3 fenced", lambda s: node.value(
            s, "gpu_device_plugin_device_condition", index=1, kind="xid", value=79) == 1
            and node.value(s, "gpu_device_plugin_device_condition", index=3, kind="fenced") == 1)
        url = "http://%s/status" % n.addr
        # Every other client keeps the JSON: curl's `*/*`, and no Accept at all (the `status` command).
        for accept in ("*/*", None):
            kind, body = n.get("/status", accept)
            if not kind.startswith("application/json") or len(json.loads(body)["devices"]) != 4:
                raise Failure("/status with Accept %r answered %s: %s" % (accept, kind, body[:500]))
        if "GPU-fa4e0000-0000-4000-8000-000000000003" not in n.command("status", "--addr", n.addr):
            raise Failure("the status command lost its table")
        dom = chromium(binary, "--dump-dom", url)
        out = tempfile.mkdtemp(prefix="gdp-screenshot-")
        try:
            shot = os.path.join(out, "status.png")
            chromium(binary, "--window-size=" + WINDOW, "--screenshot=" + shot, url)
            size, colours = pixels(shot)
            if screenshot:
                shutil.copyfile(shot, screenshot)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    page = Text()
    page.feed(dom)
    shown = " ".join(" ".join(page.all).split())
    if "GPU health: 4 devices, 2 Unhealthy" not in shown:
        raise Failure("the browser did not show the status page: %s" % dom[:2000])
    captions = list(page.tables)
    if captions != ["GPU 0 Healthy", "GPU 1 Unhealthy", "GPU 2 Healthy", "GPU 3 Unhealthy"]:
        raise Failure("the page's GPU tables are %s" % captions)
    expect(page.tables["GPU 1 Unhealthy"], "NVML index | 1", "UUID | %s" % gpu(1), "Resource | nvidia.com/gpu",
           "Health | Unhealthy", "XID 79: the GPU has fallen off the bus", "xid-79 Unhealthy auto once",
           "Fences | none", where="GPU 1's table")
    expect(page.tables["GPU 3 Unhealthy"], "UUID | %s" % gpu(3), "fenced by", "burn-in failed",
           "via the control socket", "Fences | By Why Since", where="GPU 3's table")
    expect(page.tables["GPU 0 Healthy"], "Health | Healthy", "Message | none", "Conditions | none",
           where="GPU 0's table")
    red, green = colours.get(RED, 0), colours.get(GREEN, 0)
    # Two badges per GPU (caption and health row) and a bar down its table's side: thousands of pixels of
    # each colour, and a few percent of the page at most: the colour marks the health, it does not fill the
    # tables (text on red is hard to read).
    total = size[0] * size[1]
    if not (500 < red < 0.03 * total and 500 < green < 0.03 * total):
        raise Failure("the screenshot (%dx%d) shows the health colours wrong: %d red and %d green pixels"
                      % (size[0], size[1], red, green))
    print("browser: Chromium showed /status during a fault: 4 GPU tables, GPU 1 Unhealthy (xid-79, with its "
          "message), GPU 3 fenced (who and why), health in colour (%d red, %d green pixels in a %dx%d "
          "screenshot)%s" % (red, green, size[0], size[1],
                             "; screenshot written to %s" % screenshot if screenshot else ""))


if __name__ == "__main__":
    node.main_guard(run)
