// The run page: draw the server-built figures, then append what the server-sent event stream
// reports (chart points, log lines, run events, status) without reloading.
(function () {
  "use strict";
  var figures = JSON.parse(document.getElementById("run-figures").textContent);
  var live = JSON.parse(document.getElementById("run-live").textContent);
  var runEvents = JSON.parse(document.getElementById("run-events").textContent);
  // Checkpoints come every N steps: listed in the timeline, not drawn over the charts.
  var UNMARKED_EVENTS = { checkpoint: true };
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
          if (a.mode) { trace.mode = a.mode; trace.marker = { size: 5, color: a.color }; }
          if (a.mode && a.symbol) trace.marker.symbol = a.symbol;
          if (a.hovertemplate) trace.hovertemplate = a.hovertemplate;
          if (a.yaxis) trace.yaxis = a.yaxis;
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
    // A cancelling run's cancel is under way: a second one has nothing to add.
    if (cancel) cancel.hidden = s.finished || s.status === "cancelling";
    s.workers.forEach(function (w) {
      var row = document.querySelector('#plan tr[data-rank="' + w.rank + '"]');
      if (!row) return;
      row.querySelector('[data-col="status"]').replaceChildren(badge(w.status));
      row.querySelector('[data-col="exit"]').textContent =
        (w.exit_code !== null ? "exit " + w.exit_code : "") + (w.reason ? " " + w.reason : "");
    });
  }

  function eventRow(e) {
    var li = document.createElement("li");
    li.className = "small";
    li.setAttribute("data-event-id", e.id);
    li.setAttribute("data-kind", e.kind);
    var dot = document.createElement("span");
    dot.className = "dot";
    dot.style.background = e.color;
    var when = document.createElement("span");
    when.className = "muted";
    when.textContent = " " + e.at.slice(0, 19).replace("T", " ") + " · " + Math.round(e.x) + " s" +
      (e.step !== null ? " · step " + e.step : "") + " ";
    var label = document.createElement("strong");
    label.textContent = e.label;
    li.append(dot, when, label);
    if (e.detail) {
      var detail = document.createElement("span");
      detail.className = "muted";
      detail.textContent = " " + e.detail;
      li.append(detail);
    }
    var source = document.createElement("span");
    source.className = "muted";
    source.textContent = " (" + e.source.replace("_", " ") + ")";
    li.append(source);
    return li;
  }

  function addEvents(events) {
    var list = document.getElementById("timeline-events");
    var empty = list.querySelector("[data-empty]");
    if (empty && events.length) empty.remove();
    var marked = [];
    events.forEach(function (e) {
      if (list.querySelector('[data-event-id="' + e.id + '"]')) return;
      list.appendChild(eventRow(e));
      if (!UNMARKED_EVENTS[e.kind]) marked.push(e);
    });
    list.scrollTop = list.scrollHeight;
    if (!marked.length) return;
    Object.keys(charts).forEach(function (key) {
      var div = charts[key];
      var shapes = (div.layout.shapes || []).concat(marked.map(function (e) {
        return { type: "line", xref: "x", yref: "paper", x0: e.x, x1: e.x, y0: 0, y1: 1,
          line: { color: e.color, width: 1.2, dash: "dot" }, name: "event:" + e.id };
      }));
      Plotly.relayout(div, { shapes: shapes });
    });
    hybridtrain.events += events.length;
  }
  hybridtrain.events = 0;

  // The data sets' first epoch: the server words each line (app.cache_warmup), the page shows them.
  function showWarmup(datasets) {
    var section = document.getElementById("data-warmup");
    if (!section) return;
    var items = datasets.map(function (w) {
      var li = document.createElement("li");
      li.setAttribute("data-dataset", w.dataset);
      li.setAttribute("data-state", w.state);
      var name = document.createElement("strong");
      name.textContent = w.dataset;
      var summary = document.createElement("span");
      summary.setAttribute("data-col", "summary");
      summary.textContent = w.summary;
      var sites = document.createElement("ul");
      sites.className = "small muted";
      w.sites.forEach(function (s) {
        var item = document.createElement("li");
        item.textContent = s.summary;
        sites.appendChild(item);
      });
      li.append(name, ": ", summary, sites);
      return li;
    });
    var list = document.getElementById("data-warmup-list");
    list.replaceChildren.apply(list, items);
    section.hidden = !datasets.length;
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
    var url = "/runs/" + live.run_id + "/stream?metrics_after=" + live.metrics_after + "&logs_after=" + live.logs_after +
      "&events_after=" + runEvents.after;
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
    source.addEventListener("events", function (e) {
      var payload = JSON.parse(e.data);
      runEvents.after = payload.after;
      addEvents(payload.events);
    });
    source.addEventListener("data", function (e) { showWarmup(JSON.parse(e.data).datasets); });
    source.addEventListener("status", function (e) { showStatus(JSON.parse(e.data)); });
    source.addEventListener("end", function () { source.close(); setLive("closed", "finished"); });
  }
  connect();
})();
