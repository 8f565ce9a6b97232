// The launch form: show the fields of the chosen options, preview the plan (batch split and
// server placement) from the server's planner as the form changes, with every strategy's
// predicted throughput and cost side by side; "Suggest" asks the optimizer and fills the form.
(function () {
  "use strict";
  var form = document.getElementById("launch-form");
  if (!form) return;
  var state = document.getElementById("plan-state");
  var body = document.getElementById("plan-body");
  var predictionBody = document.getElementById("prediction-body");
  var suggestButton = document.getElementById("suggest-button");
  var explanation = document.getElementById("suggest-explanation");
  var colors = ["#2f6fed", "#e4572e", "#17a398", "#f3a712", "#7b5ea7", "#db3a7a", "#4c9f38", "#8c6d46", "#3fa7d6", "#6c757d"];
  var timer = null;
  var sequence = 0;

  function syncSections() {
    ["place", "kind"].forEach(function (name) {
      var chosen = form.querySelector("input[name=" + name + "]:checked").value;
      form.querySelectorAll("[data-" + name + "]").forEach(function (el) { el.hidden = el.getAttribute("data-" + name) !== chosen; });
    });
    var length = form.querySelector("input[name=length]:checked").value;
    form.querySelectorAll("[data-length]").forEach(function (el) { el.hidden = el.getAttribute("data-length") !== length; });
  }

  // Each strategy's defaults (hybridtrain/strategy_defaults.py) as the blank fields' placeholders.
  var defaults = JSON.parse(form.getAttribute("data-defaults") || "{}");
  function syncDefaults() {
    var shown = defaults[document.getElementById("f-strategy").value] || {};
    form.querySelectorAll("input[data-default]").forEach(function (input) { input.placeholder = shown[input.name] || ""; });
  }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fixed(value, digits) {
    return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
  }

  function usd(value, digits) {
    return value === null || value === undefined ? "—" : "$" + Number(value).toFixed(digits);
  }

  function ms(seconds) {
    if (seconds === undefined || seconds === null) return "—";
    var v = seconds * 1000;
    if (v === 0) return "0";
    return v.toFixed(v >= 10 ? 0 : v >= 1 ? 1 : 2);
  }

  // Every strategy's predicted samples/s, step breakdown, granularity and $ side by side.
  function renderPredictions(json, chosen) {
    predictionBody.replaceChildren();
    if (!json.predictions || !json.predictions.length) {
      var why = json.predictions_unavailable;
      if (why) predictionBody.appendChild(el("p", { "class": "small muted", "id": "prediction-unavailable" }, "No prediction: " + why));
      renderInputs(json);
      return;
    }
    predictionBody.appendChild(el("h3", {}, "Predicted, per strategy"));
    var table = el("table", { "class": "table plan-table", "id": "prediction-table" });
    var head = el("tr");
    ["Strategy", "Samples/s", "Step ms", "Granularity", "Egress $/h", "Compute $/h", "$ / 1M samples"].forEach(function (h) {
      head.appendChild(el("th", h === "Step ms" ? { "title": "compute · compress · upload · server · download, in ms" } : {}, h));
    });
    table.appendChild(el("thead")).appendChild(head);
    var tbody = el("tbody");
    json.predictions.forEach(function (p) {
      var b = p.breakdown || {};
      var row = el("tr", { "data-strategy": p.strategy });
      if (p.strategy === chosen) row.setAttribute("class", "chosen");
      var name = el("td", {}, p.strategy);
      if (p.server) name.appendChild(el("div", { "class": "small muted" }, "server " + p.server));
      row.appendChild(name);
      row.appendChild(el("td", { "class": "num" }, fixed(p.samples_per_s, 1)));
      var parts = el("td", { "class": "num", "title": "step " + ms(p.step_s) + " ms" },
        [b.compute_s, b.compress_s, b.upload_s, b.server_s, b.download_s].map(ms).join("·"));
      parts.style.whiteSpace = "nowrap";
      row.appendChild(parts);
      row.appendChild(el("td", { "class": "num" }, fixed(p.granularity, 2)));
      row.appendChild(el("td", { "class": "num" }, usd(p.egress_usd_per_h, 3)));
      row.appendChild(el("td", { "class": "num" }, usd(p.compute_usd_per_h, 3)));
      row.appendChild(el("td", { "class": "num" }, usd(p.usd_per_million_samples, 4)));
      tbody.appendChild(row);
    });
    table.appendChild(tbody);
    // Seven columns outgrow the card on a narrow screen: scroll them rather than overflow.
    var scroller = el("div");
    scroller.style.overflowX = "auto";
    scroller.appendChild(table);
    predictionBody.appendChild(scroller);
    predictionBody.appendChild(el("p", { "class": "small muted" },
      "Step ms: compute · compress · upload · server · download. Egress is billed per byte sent; compute per node-hour."));
    if (json.egress_callout) {
      predictionBody.appendChild(el("p", { "class": "flash flash-info", "id": "egress-callout", "role": "note" }, json.egress_callout));
    }
    renderInputs(json);
  }

  function bytes(value) {
    if (value === null || value === undefined) return "—";
    var units = ["B", "kB", "MB", "GB"], i = 0;
    while (value >= 1000 && i < units.length - 1) { value /= 1000; i++; }
    return value.toFixed(value >= 100 || i === 0 ? 0 : 1) + " " + units[i];
  }

  // Where each strategy wins on these nodes and links: the plan's comparison, most samples/s first.
  function renderStrategies(plan) {
    var rows = plan.strategies || [];
    if (!rows.length) return;
    var section = el("div", { "id": "strategy-comparison" });
    section.appendChild(el("h3", {}, "Where each strategy wins"));
    var table = el("table", { "class": "table plan-table", "id": "strategy-table" });
    var head = el("tr");
    ["Strategy", "Samples/s", "Of ideal", "WAN / sample", "$ / 1M samples"].forEach(function (h) {
      head.appendChild(el("th", h === "Of ideal" ? { "title": "samples/s over the workers' compute-only samples/s" } : {}, h));
    });
    table.appendChild(el("thead")).appendChild(head);
    var tbody = el("tbody");
    var cheapest = Math.min.apply(null, rows.map(function (r) { return r.usd_per_million_samples === null ? Infinity : r.usd_per_million_samples; }));
    rows.forEach(function (r, i) {
      var row = el("tr", { "data-strategy": r.name });
      if (r.chosen) row.setAttribute("class", "chosen");
      var name = el("td", {}, r.name);
      var marks = [];
      if (r.chosen) marks.push("chosen");
      if (i === 0) marks.push("fastest");
      if (r.usd_per_million_samples === cheapest) marks.push("cheapest");
      if (marks.length) name.appendChild(el("div", { "class": "small muted" }, marks.join(" · ")));
      row.appendChild(name);
      row.appendChild(el("td", { "class": "num" }, fixed(r.samples_per_s, 1)));
      row.appendChild(el("td", { "class": "num" }, (r.ideal_share * 100).toFixed(0) + "%"));
      row.appendChild(el("td", { "class": "num" }, bytes(r.wan_bytes_per_sample)));
      row.appendChild(el("td", { "class": "num" }, usd(r.usd_per_million_samples, 4)));
      tbody.appendChild(row);
    });
    table.appendChild(tbody);
    var scroller = el("div");
    scroller.style.overflowX = "auto";
    scroller.appendChild(table);
    section.appendChild(scroller);
    section.appendChild(el("p", { "class": "small muted" },
      "Each strategy on these nodes and links with its defaults where the form leaves options blank; " +
      "+replicas: local SGD with each site's workers one replica (they average every step over the site's LAN)."));
    predictionBody.insertBefore(section, predictionBody.firstChild);
  }

  // What the numbers rest on: each node's profile (how old, how noisy, profiler or a run) and each link.
  function renderInputs(json) {
    if (!json.inputs || !json.inputs.length) return;
    var list = el("ul", { "class": "small muted", "id": "prediction-inputs" });
    json.inputs.forEach(function (line) { list.appendChild(el("li", {}, line)); });
    predictionBody.appendChild(el("h4", {}, "Inputs"));
    predictionBody.appendChild(list);
  }

  function renderErrors(errors) {
    body.replaceChildren();
    predictionBody.replaceChildren();
    var list = el("ul", { "class": "plan-errors" });
    Object.keys(errors).forEach(function (field) {
      var label = field === "__form__" ? "" : field.replace(/_/g, " ") + ": ";
      list.appendChild(el("li", {}, label + errors[field]));
    });
    body.appendChild(list);
    state.textContent = "cannot plan this yet";
  }

  function renderPlan(plan) {
    body.replaceChildren();
    var workers = plan.workers.filter(function (w) { return w.role === "worker"; });
    var server = plan.workers.filter(function (w) { return w.role === "ps"; })[0];
    var summary = el("p", { "class": "small" });
    summary.textContent = workers.length + " worker" + (workers.length === 1 ? "" : "s") +
      ", global batch " + plan.global_batch_size + " split " + plan.allocation +
      ", " + (plan.max_steps === null ? "steps counted by the trainer from the epochs" : plan.max_steps + " steps") + ". " +
      (plan.task ? "Task profiled on " + plan.task.profiled_nodes.length + " node(s)" +
        (plan.task.params ? ", " + plan.task.params.toLocaleString() + " parameters" : "") +
        (plan.task.train_samples ? ", " + plan.task.train_samples.toLocaleString() + " training samples" : "") + ". " : "") +
      (server ? "Parameter server on " + server.node_name + "." : "All-reduce between the workers (no server).");
    body.appendChild(summary);
    var bar = el("div", { "class": "split-bar", "id": "plan-split" });
    workers.forEach(function (w, i) {
      var part = el("span", { "title": "rank " + w.rank + ": " + w.batch_size }, String(w.batch_size));
      part.style.flex = String(w.batch_size);
      part.style.background = colors[i % colors.length];
      bar.appendChild(part);
    });
    body.appendChild(bar);
    var table = el("table", { "class": "table plan-table", "id": "plan-table" });
    var head = el("tr");
    ["Rank", "Role", "Node", "GPU", "Batch", "Speed"].forEach(function (h) { head.appendChild(el("th", {}, h)); });
    table.appendChild(el("thead")).appendChild(head);
    var tbody = el("tbody");
    plan.workers.forEach(function (w) {
      var row = el("tr", { "data-rank": String(w.rank) });
      row.appendChild(el("td", {}, String(w.rank)));
      row.appendChild(el("td", {}, w.role === "ps" ? "server" : "worker"));
      row.appendChild(el("td", {}, w.node_name));
      row.appendChild(el("td", {}, w.gpu_model ? w.gpu_model + (w.gpu_index !== null ? " #" + w.gpu_index : "") : "—"));
      row.appendChild(el("td", { "class": "num" }, w.batch_size === null ? "—" : String(w.batch_size)));
      row.appendChild(el("td", { "class": "num" }, w.speed === null ? "—" : w.speed + " " + (w.speed_unit || "")));
      tbody.appendChild(row);
    });
    table.appendChild(tbody);
    body.appendChild(table);
    state.textContent = "what Launch will start";
  }

  function preview() {
    var mine = ++sequence;
    state.textContent = "planning…";
    // The preview plans from the text fields; an archive is uploaded only on launch.
    var fields = new FormData(form);
    fields.delete("bundle_file");
    var data = new URLSearchParams(fields);
    fetch("/runs/plan", {
      method: "POST", body: data, credentials: "same-origin",
      headers: { "Accept": "application/json", "Content-Type": "application/x-www-form-urlencoded" }
    }).then(function (response) {
      return response.json().then(function (json) { return { ok: response.ok, json: json }; });
    }).then(function (result) {
      if (mine !== sequence) return;  // a newer preview is on its way
      if (result.ok) {
        renderPlan(result.json.plan);
        renderPredictions(result.json, result.json.plan.strategy);
        renderStrategies(result.json.plan);
      } else renderErrors(result.json.errors || { "__form__": result.json.detail || "cannot plan" });
    }).catch(function () {
      if (mine === sequence) state.textContent = "preview unavailable";
    });
  }

  // The optimizer's choice fills the form (nodes, strategy, server, split), then re-previews.
  function applySuggestion(s) {
    var place = form.querySelector("input[name=place][value=nodes]");
    if (place) place.checked = true;
    form.querySelectorAll("input[name=node_ids]").forEach(function (box) {
      box.checked = s.node_ids.indexOf(Number(box.value)) !== -1;
    });
    document.getElementById("f-strategy").value = s.strategy;
    document.getElementById("f-ps_node_id").value = s.ps_node_id === null ? "" : String(s.ps_node_id);
    document.getElementById("f-allocation").value = s.allocation;
    explanation.textContent = s.explanation;
    explanation.hidden = false;
    syncSections();
    syncDefaults();
    preview();
  }

  function suggest() {
    var fields = new FormData(form);
    fields.delete("bundle_file");
    explanation.hidden = false;
    explanation.textContent = "searching…";
    suggestButton.disabled = true;
    fetch("/runs/suggest", {
      method: "POST", body: new URLSearchParams(fields), credentials: "same-origin",
      headers: { "Accept": "application/json", "Content-Type": "application/x-www-form-urlencoded" }
    }).then(function (response) {
      return response.json().then(function (json) { return { ok: response.ok, json: json }; });
    }).then(function (result) {
      if (result.ok) { applySuggestion(result.json.suggestion); return; }
      var errors = result.json.errors || { "__form__": result.json.detail || "cannot suggest" };
      explanation.textContent = Object.keys(errors).map(function (k) {
        return (k === "__form__" ? "" : k.replace(/_/g, " ") + ": ") + errors[k];
      }).join("; ");
    }).catch(function () {
      explanation.textContent = "suggestion unavailable";
    }).then(function () { suggestButton.disabled = false; });
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(preview, 250);
  }

  form.addEventListener("change", function () { syncSections(); syncDefaults(); schedule(); });
  form.addEventListener("input", schedule);
  if (suggestButton) suggestButton.addEventListener("click", suggest);
  form.addEventListener("submit", function () {
    document.getElementById("launch-button").disabled = true;
  });
  syncSections();
  if (form.querySelector("input[name=node_ids]:checked") || form.querySelector("#f-cluster_id").value) preview();
})();
