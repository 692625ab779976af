// gpuwatch dashboard: optional auto-refresh, the fleet page's tiles (drawn here from the
// figures each host card carries), its host filter and its tiles' tooltips. No data is
// fetched here: every page comes from the server with what it shows.
"use strict";
(function () {
  var REFRESH_SECONDS = 30;
  var KEY = "gpuwatch.autorefresh";

  function setUpRefresh() {
    var box = document.getElementById("autorefresh");
    if (!box) return;
    var timer = null;
    function schedule() {
      if (timer) clearTimeout(timer);
      timer = null;
      if (box.checked && !document.hidden) {
        timer = setTimeout(function () { location.reload(); }, REFRESH_SECONDS * 1000);
      }
    }
    try { box.checked = localStorage.getItem(KEY) === "1"; } catch (e) { /* storage off */ }
    box.addEventListener("change", function () {
      try { localStorage.setItem(KEY, box.checked ? "1" : "0"); } catch (e) { /* storage off */ }
      schedule();
    });
    document.addEventListener("visibilitychange", schedule);
    schedule();
  }

  var ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, function (c) { return ESCAPES[c]; });
  }

  // An agent-sent name as the server's pages show it (gpuwatch/terminal_text.py):
  // controls, direction overrides and other invisible characters as escapes
  // ("\u202e"), so none can reverse what a tile or its tooltip shows.
  var HIDDEN = /[\x00-\x1f\x7f-\x9f\p{Cf}\p{Zl}\p{Zp}\p{Cs}]/gu;
  var NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"};

  function printable(text) {
    return text.replace(HIDDEN, function (ch) {
      if (NAMED[ch]) return NAMED[ch];
      var code = ch.codePointAt(0);
      var hex = code.toString(16);
      if (code <= 0xff) return "\\x" + ("0" + hex).slice(-2);
      if (code <= 0xffff) return "\\u" + ("000" + hex).slice(-4);
      return "\\U" + ("0000000" + hex).slice(-8);
    });
  }

  // A tile's text: its holder's first three characters, or, for a name ending in
  // digits (user0 .. user36 all began "use"), its first ones and its last two digits.
  function initials(name) {
    var chars = Array.from(name);
    var digits = /[0-9]{1,2}$/.exec(name);
    if (chars.length <= 3 || !digits) return chars.slice(0, 3).join("");
    return chars.slice(0, 3 - digits[0].length).join("") + digits[0];
  }

  // Each host card of the fleet page carries its GPUs in data-t, as ingest keeps them
  // (gpuwatch/server/hosts/tiles.py): per GPU [index, whole percent used (null: no
  // current reading), used MiB, total MiB, largest holder's MiB, processes, users,
  // largest holder's name, open flags as a bit mask]. A tile is a link to its GPU,
  // coloured by tenths of fullness (grey "u" when unread, lost or its host silent),
  // with a class per open flag (bit i: the i-th class of the fleet's data-flags), the
  // holder's initials as text ("+": other users hold some too; "✕": lost), and its
  // figures in data-v for the tooltip. Drawn as markup per host (one innerHTML): for
  // 8,000 tiles far quicker than creating elements one by one.
  function drawTiles() {
    var fleet = document.querySelector(".fleet[data-flags]");
    if (!fleet) return;
    var bits = fleet.getAttribute("data-flags").split(" ");
    var lost = 1 << bits.indexOf("l");
    var flagClasses = [];
    for (var mask = 0; mask < 1 << bits.length; mask++) {
      var classes = "";
      for (var bit = 0; bit < bits.length; bit++) {
        if (mask & 1 << bit) classes += " " + bits[bit];
      }
      flagClasses.push(classes);
    }
    var names = {};  // a holder's name -> [escaped name, initials, initials + "+"]
    function namesOf(user) {
      var name = user ? String(user) : "?";
      var known = names[name];
      if (!known) {
        var shown = printable(name);
        var short = escapeHtml(initials(shown));
        known = names[name] = [escapeHtml(shown), short, short + "+"];
      }
      return known;
    }
    var hosts = fleet.querySelectorAll(".host[data-t]");
    for (var h = 0; h < hosts.length; h++) {
      var host = hosts[h];
      var tiles = JSON.parse(host.getAttribute("data-t"));
      var grey = host.classList.contains("silent");
      // Where a tile links, less its GPU index (templates/fleet.py, format.gpus_prefix).
      var gpus = escapeHtml(host.getAttribute("data-g"));
      var out = [];
      var flagged = false;
      for (var i = 0; i < tiles.length; i++) {
        var t = tiles[i];
        var flags = t[8];
        var text = flags & lost ? "✕" : "";
        var holder = "0 0 0 ";
        if (t[5]) {
          var known = namesOf(t[7]);
          if (!text) text = t[6] > 1 ? known[2] : known[1];
          holder = t[4] + " " + t[5] + " " + t[6] + " " + known[0];
        }
        var css, figures;
        if (grey || t[1] === null) {
          css = "u";
          figures = "- " + holder;
        } else {
          css = "c" + Math.min(Math.floor(t[1] / 10), 9);
          figures = t[1] + " " + t[2] + " " + t[3] + " " + holder;
        }
        flagged = flagged || flags !== 0;
        out.push('<a class="t ' + css + flagClasses[flags] + '" href="' + gpus + t[0] +
          '" data-v="' + figures + '">' + text + "</a>");
      }
      host.querySelector(".tiles").innerHTML = out.join("");
      if (flagged) host.classList.add("flagged");
    }
  }

  function setUpFleetFilter() {
    var input = document.getElementById("hostfilter");
    var flagged = document.getElementById("onlyflagged");
    if (!input || !flagged) return;
    var hosts = document.querySelectorAll(".fleet > .host");
    function apply() {
      var text = input.value.trim().toLowerCase();
      var onlyFlagged = flagged.checked;
      for (var i = 0; i < hosts.length; i++) {
        var host = hosts[i];
        var show = (!text || host.getAttribute("data-h").toLowerCase().indexOf(text) !== -1) &&
          (!onlyFlagged || host.classList.contains("flagged"));
        host.hidden = !show;
      }
    }
    input.addEventListener("input", apply);
    flagged.addEventListener("change", apply);
    if (input.value || flagged.checked) apply();
  }

  // A fleet tile carries its figures in data-v (see templates/fleet.py): whole percent
  // used ("-": no current reading), used and total MiB, the largest holder's MiB, how
  // many processes and users hold memory, that holder's name. Its tooltip is worded
  // from them when the tile is first hovered or focused, rather than sent in full with
  // each of thousands of tiles.
  var TILE_FLAGS = {o: "orphaned", i: "idle holder", f: "filling up", r: "runaway", l: "lost"};

  function gib(mib) {
    return (Number(mib) / 1024).toFixed(1);
  }

  function count(n, one, many) {
    return n + " " + (n === "1" ? one : many);
  }

  function tileTitle(tile) {
    var v = tile.getAttribute("data-v").split(" ");
    var href = tile.getAttribute("href");
    // A silent host's figures are its last report's, not current: said so.
    var host = tile.closest(".host");
    var silent = host !== null && host.classList.contains("silent");
    // The index ends the link, after "/gpus/" or, for a host named "." or "..", "gpu=".
    var lines = ["GPU " + /[0-9]*$/.exec(href)[0] + ": " + (v[0] === "-" ?
      "no current reading" + (silent ? " (host silent)" : "") :
      gib(v[1]) + " of " + gib(v[2]) + " GiB (" + v[0] + "%)")];
    var holder = v[0] === "-" ? v.slice(1) : v.slice(3);
    var known = silent ? "at the last report: " : "";
    if (tile.classList.contains("l")) {
      lines.push("fallen off the bus");
    } else if (holder[1] === "0") {
      lines.push(known + "no processes");
    } else {
      lines.push(known + "largest: " + holder.slice(3).join(" ") + " " + gib(holder[0]) +
        " GiB · " + count(holder[1], "process", "processes") + ", " +
        count(holder[2], "user", "users"));
    }
    var flags = [];
    for (var css in TILE_FLAGS) {
      if (tile.classList.contains(css)) flags.push(TILE_FLAGS[css]);
    }
    if (flags.length) lines.push(flags.join(", "));
    return lines.join("\n");
  }

  function setUpTileTitles() {
    var fleet = document.querySelector(".fleet");
    if (!fleet) return;
    function describe(event) {
      var tile = event.target.closest && event.target.closest("a.t[data-v]");
      if (tile && !tile.title) tile.title = tileTitle(tile);
    }
    fleet.addEventListener("mouseover", describe);
    fleet.addEventListener("focusin", describe);
  }

  setUpRefresh();
  drawTiles();
  setUpFleetFilter();
  setUpTileTitles();
})();
