"""The style sheet and script of :class:`attnflow.html.InteractiveView` (inline, no CDN).

The script is plain ES5 inside a function called with the view's element id: it reads the
view's JSON data from ``<script type="application/json" id="ID-data">``, wires the
controls and re-colours the token spans and, for a view with a patch grid, its cells (the
token elements in document order: the leading spans, then the cells row by row). It computes colours and formats values exactly
as the Python side does for the first render (see :func:`attnflow.html._token_style`),
so a page looks the same before and after the script runs (over an image, the cells as
:func:`attnflow.html._cell_style` does; a signed method on the diverging scale's stops,
as :func:`attnflow._colours.signed_rgb` blends them). Tokens left out of the scale
get no colour of it: their inline colours are removed and the ``attnflow-unscaled`` class
of the shared style sheet (``attnflow.html._CSS``) gives them their neutral look.
"""

from __future__ import annotations

__all__ = ["INTERACTIVE_CSS", "INTERACTIVE_JS"]

INTERACTIVE_CSS = """\
.attnflow-interactive .attnflow-controls { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em;
  align-items: center; font-size: 12px; color: #333; margin-bottom: 0.2em; }
.attnflow-interactive .attnflow-controls label { display: inline-flex; align-items: center;
  gap: 0.4em; }
.attnflow-interactive .attnflow-controls [hidden] { display: none; }
.attnflow-interactive .attnflow-controls output { min-width: 4.5em; color: #555; }
.attnflow-interactive .attnflow-tok[tabindex] { cursor: pointer; }
.attnflow-interactive .attnflow-tok:focus-visible { outline: 2px solid #1a5fb4;
  outline-offset: 1px; }
.attnflow-interactive .attnflow-tok.attnflow-current { border-color: #222;
  box-shadow: inset 0 -3px 0 #222; }
.attnflow-interactive .attnflow-cell[tabindex] { cursor: pointer; }
.attnflow-interactive .attnflow-cell:focus-visible { outline: 2px solid #1a5fb4;
  outline-offset: 1px; z-index: 6; }
.attnflow-interactive .attnflow-cell.attnflow-current { border-color: #222;
  box-shadow: inset 0 0 0 2px #222; }
.attnflow-interactive .attnflow-status { font-size: 11px; color: #555; line-height: 1.4; }
"""

# Kept free of "</" so that it can never close its <script> element.
INTERACTIVE_JS = """\
(function (id) {
  "use strict";
  var root = document.getElementById(id);
  var source = document.getElementById(id + "-data");
  if (!root || !source || root.getAttribute("data-ready") === "1") { return; }
  root.setAttribute("data-ready", "1");
  var data = JSON.parse(source.textContent);
  /* Every token, in order: the spans and the cells of a patch grid (after the spans). */
  var tokens = root.querySelectorAll(".attnflow-tok, .attnflow-cell");
  function control(name) { return root.querySelector('[data-control="' + name + '"]'); }
  function output(name) { return root.querySelector('[data-output="' + name + '"]'); }
  var method = control("method"), layer = control("layer"), row = control("row");
  var head = control("head");
  var state = { method: data.initial.method, layer: data.initial.layer,
                row: data.initial.row, head: data.initial.head };

  function strip(text) {
    if (text.indexOf(".") < 0) { return text; }
    return text.replace(/0+$/, "").replace(/[.]$/, "");
  }
  function format(value) {  /* Python's "%.<precision>g" */
    var p = data.precision;
    if (value === 0) { return "0"; }
    var scientific = value.toExponential(p - 1);
    var at = scientific.indexOf("e");
    var exponent = parseInt(scientific.slice(at + 1), 10);
    if (exponent < -4 || exponent >= p) {
      var size = Math.abs(exponent);
      return strip(scientific.slice(0, at)) + "e" + (exponent < 0 ? "-" : "+") +
        (size < 10 ? "0" : "") + size;
    }
    return strip(value.toFixed(p - 1 - exponent));
  }
  function signedColour(value, top) {  /* the diverging scale: blend of two stops */
    var stops = data.stops, last = stops.length - 1;
    var share = top > 0 ? Math.min(1, Math.max(-1, value / top)) : 0;
    var place = (share + 1) / 2 * last;
    var low = Math.min(Math.floor(place), last - 1), fraction = place - low;
    var rgb = [0, 1, 2].map(function (k) {
      var a = stops[low][k], b = stops[low + 1][k];
      return Math.floor(a + (b - a) * fraction + 0.5);
    });
    var dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140;
    return ["rgb(" + rgb.join(", ") + ")", dark ? "#fff" : "#222"];
  }
  function colour(value, top, signed) {
    if (signed) { return signedColour(value, top); }
    var strength = top > 0 ? Math.min(1, Math.max(0, value / top)) : 0;
    var rgb = data.rgb.map(function (c) { return Math.round(255 + (c - 255) * strength); });
    var dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140;
    return ["rgb(" + rgb.join(", ") + ")", dark ? "#fff" : "#222"];
  }
  function cellColour(value, top, signed) {  /* over an image: more opaque with the score */
    var rgb = data.rgb;
    if (signed) {
      rgb = value < 0 ? data.stops[0] : data.stops[data.stops.length - 1];
      value = Math.abs(value);
    }
    var strength = top > 0 ? Math.min(1, Math.max(0, value / top)) : 0;
    var alpha = Math.floor(1000 * data.cellOpacity * strength + 0.5) / 1000;
    return ["rgba(" + rgb.join(", ") + ", " + String(alpha) + ")", "#222"];
  }
  function bar(top, signed) {
    if (!signed) {
      return "linear-gradient(to right, rgb(255, 255, 255), " + colour(top, top)[0] + ")";
    }
    return "linear-gradient(to right, " + data.stops.map(function (c) {
      return "rgb(" + c.join(", ") + ")";
    }).join(", ") + ")";
  }
  function pickedLayer(m) { return Math.min(state.layer, m.layers - 1); }
  function pickedHead(m) { return m.heads ? Math.min(state.head, m.heads - 1) : 0; }

  function render() {
    var m = data.methods[state.method];
    var l = pickedLayer(m), h = pickedHead(m);
    var values = m.values[l][h][state.row];
    var top = 0, i, signed = m.signed;
    for (i = 0; i < values.length; i++) {
      var size = signed ? Math.abs(values[i]) : values[i];
      if (data.inScale[i] && size > top) { top = size; }
    }
    var position = data.rows === null ? -1 : data.rows[state.row];
    for (i = 0; i < tokens.length; i++) {
      var span = tokens[i], shown = format(values[i]), scaled = data.inScale[i];
      var overImage = data.overImage && span.classList.contains("attnflow-cell");
      var paint = !scaled ? ["", ""] :  /* "": the class's look */
        (overImage ? cellColour(values[i], top, signed) : colour(values[i], top, signed));
      span.style.backgroundColor = paint[0];
      span.style.color = paint[1];
      span.classList.toggle("attnflow-unscaled", !scaled);
      span.setAttribute("data-value", shown);
      span.title = data.tokens[i] + ": " + shown;
      var current = i === position;
      span.classList.toggle("attnflow-current", current);
      if (current) { span.setAttribute("aria-current", "true"); }
      else { span.removeAttribute("aria-current"); }
    }
    method.value = String(state.method);
    layer.max = String(m.layers);
    layer.value = String(l + 1);
    layer.disabled = m.layers === 1;
    var layerText = (l + 1) + " of " + m.layers;
    layer.setAttribute("aria-valuetext", "layer " + layerText);
    output("layer").textContent = layerText;
    row.value = String(state.row);
    control("head-label").hidden = !m.heads;
    if (m.heads) {
      head.max = String(m.heads);
      head.value = String(h + 1);
      var headText = (h + 1) + " of " + m.heads;
      head.setAttribute("aria-valuetext", "head " + headText);
      output("head").textContent = headText;
    }
    output("max").textContent = format(top);
    output("min").textContent = signed && top > 0 ? format(-top) : "0";
    output("bar").style.background = bar(top, signed);
    var parts = [m.name, "layer " + layerText];
    if (position >= 0) { parts.push("row " + position + " (" + data.headings[position] + ")"); }
    if (m.heads) { parts.push("head " + (h + 1) + " of " + m.heads); }
    output("status").textContent = parts.join(", ");
  }

  method.addEventListener("change", function () { state.method = +method.value; render(); });
  layer.addEventListener("input", function () { state.layer = +layer.value - 1; render(); });
  row.addEventListener("change", function () { state.row = +row.value; render(); });
  head.addEventListener("input", function () { state.head = +head.value - 1; render(); });
  function pick(event) {
    var index = event.currentTarget.getAttribute("data-row");
    if (index === null) { return; }
    if (event.type === "keydown") {
      if (event.key !== "Enter" && event.key !== " ") { return; }
      event.preventDefault();
    }
    state.row = +index;
    render();
  }
  for (var i = 0; i < tokens.length; i++) {
    tokens[i].addEventListener("click", pick);
    tokens[i].addEventListener("keydown", pick);
  }
  render();
})"""
