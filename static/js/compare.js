// The comparison page: draw the server-built figures.
(function () {
  "use strict";
  var figures = JSON.parse(document.getElementById("compare-figures").textContent);
  Object.keys(figures).forEach(function (key) {
    var div = document.getElementById("chart-" + key);
    if (div) Plotly.newPlot(div, figures[key].data, figures[key].layout, { responsive: true, displaylogo: false });
  });
})();
