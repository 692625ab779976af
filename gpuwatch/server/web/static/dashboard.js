// gpuwatch dashboard: optional auto-refresh, the fleet page's host filter and its tiles'
// tooltips. No data is fetched here: every page is rendered by the server.
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

  function tileTitle(tile) {
    var v = tile.getAttribute("data-v").split(" ");
    var href = tile.getAttribute("href");
    var lines = ["GPU " + href.slice(href.lastIndexOf("/") + 1) + ": " + (v[0] === "-" ?
      "no current reading" : gib(v[1]) + " of " + gib(v[2]) + " GiB (" + v[0] + "%)")];
    var holder = v[0] === "-" ? v.slice(1) : v.slice(3);
    if (tile.classList.contains("l")) {
      lines.push("fallen off the bus");
    } else if (holder[1] === "0") {
      lines.push("no processes");
    } else {
      lines.push("largest: " + holder.slice(3).join(" ") + " " + gib(holder[0]) + " GiB · " +
        holder[1] + " processes, " + holder[2] + " users");
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
  setUpFleetFilter();
  setUpTileTitles();
})();
