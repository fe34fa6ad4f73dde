(function () {
  var rows = Array.prototype.slice.call(document.querySelectorAll("tr.param-row"));
  var box = document.getElementById("param-filter");
  var count = document.getElementById("param-count");
  function apply() {
    var q = box.value.trim().toLowerCase();
    var shown = 0;
    rows.forEach(function (row) {
      var hit = row.getAttribute("data-name").toLowerCase().indexOf(q) >= 0;
      row.hidden = !hit;
      if (hit) { shown += 1; }
      if (hit && q) { var d = row.closest("details.group"); if (d) { d.open = true; } }
    });
    count.textContent = String(shown);
  }
  function setAll(open) {
    document.querySelectorAll("details").forEach(function (d) { d.open = open; });
  }
  var fromUrl = /[#&]filter=([^&]*)/.exec(window.location.hash);
  if (fromUrl) { box.value = decodeURIComponent(fromUrl[1]); }
  box.addEventListener("input", apply);
  document.getElementById("expand-all").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse-all").addEventListener("click", function () {
    setAll(false);
  });
  var data = JSON.parse(document.getElementById("autotp-plan").textContent);
  document.body.dataset.collectives = String(data.collectives.length);
  apply();
  document.body.dataset.ready = "1";
})();
