// The run page: draw the server-built figures, then append what the server-sent event stream
// reports (chart points, log lines, status) without reloading.
(function () {
  "use strict";
  var figures = JSON.parse(document.getElementById("run-figures").textContent);
  var live = JSON.parse(document.getElementById("run-live").textContent);
  var config = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  var charts = {};
  var MAX_LOG_LINES = 2000;

  Object.keys(figures).forEach(function (key) {
    var div = document.getElementById("chart-" + key);
    if (!div) return;
    Plotly.newPlot(div, figures[key].data, figures[key].layout, config);
    charts[key] = div;
  });

  // Tests and the latency bench read these: points drawn per chart, and when each last grew.
  var hybridtrain = window.hybridtrain = { updates: 0, lastUpdate: null, points: function (key) {
    var div = charts[key];
    return div ? div.data.reduce(function (n, t) { return n + (t.x ? t.x.length : 0); }, 0) : 0;
  }, valuesOf: function (key, uid) {
    var div = charts[key];
    var trace = div && div.data.filter(function (t) { return t.uid === uid; })[0];
    return trace ? trace.y.slice() : [];
  } };

  function traceIndex(div, uid) {
    for (var i = 0; i < div.data.length; i++) if (div.data[i].uid === uid) return i;
    return -1;
  }

  function appendPoints(appends) {
    var byChart = {};
    appends.forEach(function (a) { (byChart[a.chart] = byChart[a.chart] || []).push(a); });
    Object.keys(byChart).forEach(function (key) {
      var div = charts[key];
      if (!div) return;
      var update = { x: [], y: [], customdata: [] }, indices = [];
      byChart[key].forEach(function (a) {
        var index = traceIndex(div, a.uid);
        if (index < 0) {
          var trace = { type: "scatter", mode: "lines", uid: a.uid, name: a.name, x: [], y: [], customdata: [],
            line: { color: a.color, width: a.uid === "sps:total" ? 2.6 : 1.8 },
            hovertemplate: "%{y:.4g} (step %{customdata})" };
          if (a.mode) { trace.mode = a.mode; trace.marker = { size: 5 }; }
          if (key === "egress" || key === "batch") trace.line.shape = "hv";
          Plotly.addTraces(div, trace);
          index = div.data.length - 1;
          // A chart that showed "nothing yet" has something now.
          if (div.layout.annotations) Plotly.relayout(div, { annotations: [] });
        }
        update.x.push(a.x); update.y.push(a.y); update.customdata.push(a.customdata);
        indices.push(index);
      });
      Plotly.extendTraces(div, update, indices);
    });
    hybridtrain.updates += 1;
    hybridtrain.lastUpdate = Date.now();
  }

  function appendLogs(lines) {
    var box = document.getElementById("logs");
    var atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
    var empty = box.querySelector("[data-empty]");
    if (empty) empty.remove();
    lines.forEach(function (l) {
      var row = document.createElement("div");
      var src = document.createElement("span");
      src.className = "log-src";
      src.textContent = "[rank " + l.rank + "]";
      row.appendChild(src);
      row.appendChild(document.createTextNode(" " + l.line));
      box.appendChild(row);
    });
    while (box.childNodes.length > MAX_LOG_LINES) box.removeChild(box.firstChild);
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function badge(status) {
    var span = document.createElement("span");
    span.className = "badge status-" + status;
    span.textContent = status;
    return span;
  }

  function showStatus(s) {
    document.getElementById("run-status").replaceChildren(badge(s.status));
    var reason = document.getElementById("run-reason");
    if (reason) { reason.textContent = s.reason || ""; reason.hidden = !s.reason || s.status === "succeeded"; }
    var cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = s.finished;
    s.workers.forEach(function (w) {
      var row = document.querySelector('#plan tr[data-rank="' + w.rank + '"]');
      if (!row) return;
      row.querySelector('[data-col="status"]').replaceChildren(badge(w.status));
      row.querySelector('[data-col="exit"]').textContent =
        (w.exit_code !== null ? "exit " + w.exit_code : "") + (w.reason ? " " + w.reason : "");
    });
  }

  function setLive(state, label) {
    var el = document.getElementById("live");
    el.setAttribute("data-state", state);
    document.getElementById("live-label").textContent = label;
  }

  if (!live.active || !window.EventSource) return;

  // Reconnects are ours, not the browser's: they resume after the last rows received, so no
  // point is drawn twice.
  function connect() {
    var url = "/runs/" + live.run_id + "/stream?metrics_after=" + live.metrics_after + "&logs_after=" + live.logs_after;
    var source = new EventSource(url);
    source.addEventListener("open", function () { setLive("open", "live"); });
    source.addEventListener("error", function () {
      source.close();
      setLive("error", "reconnecting…");
      setTimeout(connect, 2000);
    });
    source.addEventListener("metrics", function (e) {
      var payload = JSON.parse(e.data);
      live.metrics_after = payload.after;
      appendPoints(payload.appends);
    });
    source.addEventListener("logs", function (e) {
      var payload = JSON.parse(e.data);
      live.logs_after = payload.after;
      appendLogs(payload.lines);
    });
    source.addEventListener("status", function (e) { showStatus(JSON.parse(e.data)); });
    source.addEventListener("end", function () { source.close(); setLive("closed", "finished"); });
  }
  connect();
})();
