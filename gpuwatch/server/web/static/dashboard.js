// gpuwatch dashboard: optional auto-refresh and the fleet page's host filter.
// No data is fetched here: every page is rendered by the server.
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

  setUpRefresh();
  setUpFleetFilter();
})();
