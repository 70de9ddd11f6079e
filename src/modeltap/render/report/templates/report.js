// modeltap report: draws the embedded plotly figures, makes the module tree collapsible and
// searchable (keyboard: Tab to a row's toggle, Enter or Space), and lets selects swap chart data.
(function () {
  "use strict";
  const figures = JSON.parse(document.getElementById("modeltap-figures").textContent);
  const variants = JSON.parse(document.getElementById("modeltap-variants").textContent);
  const config = { responsive: true, displaylogo: false };
  window.modeltapCharts = 0;

  // One chart at a time, yielding between them: the first is on screen before the others are
  // computed, and the page stays responsive while they are.
  const pending = Object.entries(figures).filter(function (entry) {
    return document.getElementById(entry[0]) !== null;
  });
  function drawNext() {
    const next = pending.shift();
    if (!next) return;
    Plotly.newPlot(document.getElementById(next[0]), next[1].data, next[1].layout, config)
      .then(function () {
        if (window.modeltapFirstChart === undefined) {
          window.modeltapFirstChart = performance.now();  // ms since navigation start
        }
        window.modeltapCharts += 1;
        setTimeout(drawNext, 0);
      });
  }
  drawNext();

  // A select swaps the data of one or more charts: variants[name][value] = {chart id: figure},
  // where a null figure is the one the page was drawn with.
  document.querySelectorAll("select[data-variants]").forEach(function (select) {
    select.addEventListener("change", function () {
      const chosen = variants[select.dataset.variants][select.value];
      for (const [id, given] of Object.entries(chosen)) {
        const figure = given === null ? figures[id] : given;  // null: the page's own figure
        const layout = Object.assign({}, figures[id].layout, figure.layout || {});
        // a variant's trace gives what differs; the rest is the page's trace at its place
        const data = figure.data.map(function (trace, i) {
          return Object.assign({}, figures[id].data[i] || {}, trace);
        });
        Plotly.react(document.getElementById(id), data, layout, config);
      }
    });
  });

  document.querySelectorAll("table.tree-table").forEach(function (table) {
    const section = table.closest("section");
    const rows = Array.from(table.tBodies[0].rows);
    const byId = new Map(rows.map(function (row) { return [row.dataset.id, row]; }));
    const children = new Map();
    rows.forEach(function (row) {
      const parent = row.dataset.parent;
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(row);
    });
    const collapsed = new Set();
    const search = section.querySelector(".tree-search");
    const shown = section.querySelector(".shown");

    function hiddenByCollapse(row) {
      for (let parent = row.dataset.parent; parent; parent = byId.get(parent).dataset.parent) {
        if (collapsed.has(parent)) return true;
      }
      return false;
    }

    function update() {
      const query = search.value.trim().toLowerCase();
      const visible = new Set();
      if (query) {
        rows.forEach(function (row) {
          if (row.dataset.name.toLowerCase().includes(query)) {
            for (let r = row; r; r = byId.get(r.dataset.parent)) visible.add(r);
          }
        });
      }
      let count = 0;
      rows.forEach(function (row) {
        const match = query !== "" && row.dataset.name.toLowerCase().includes(query);
        const hide = query ? !visible.has(row) : hiddenByCollapse(row);
        row.classList.toggle("hidden", hide);
        row.classList.toggle("match", match);
        if (!hide) count += 1;
      });
      shown.textContent = count + " of " + rows.length + " rows shown";
    }

    function setCollapsed(row, state) {
      const button = row.querySelector(".toggle");
      if (!button) return;
      if (state) collapsed.add(row.dataset.id); else collapsed.delete(row.dataset.id);
      button.setAttribute("aria-expanded", String(!state));
      button.textContent = state ? "▸" : "▾";
      button.setAttribute("aria-label", (state ? "expand " : "collapse ") + row.dataset.name);
    }

    table.addEventListener("click", function (event) {
      const button = event.target.closest(".toggle");
      const row = event.target.closest("tr[data-id]");
      if (button) {
        setCollapsed(row, !collapsed.has(row.dataset.id));
        update();
        return;
      }
      if (row && row.dataset.hist !== undefined) {
        const select = document.getElementById("hist-select");
        if (select) {
          select.value = row.dataset.hist;
          select.dispatchEvent(new Event("change"));
          rows.forEach(function (r) { r.classList.toggle("selected", r === row); });
        }
      }
    });
    section.querySelector(".expand-all").addEventListener("click", function () {
      rows.forEach(function (row) { setCollapsed(row, false); });
      update();
    });
    section.querySelector(".collapse-all").addEventListener("click", function () {
      rows.forEach(function (row) { if (children.has(row.dataset.id)) setCollapsed(row, true); });
      update();
    });
    search.addEventListener("input", update);
    update();
  });
  window.modeltapReady = true;
})();
