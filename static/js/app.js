// Small progressive enhancements shared by every page: toggled panels and copy buttons.
(function () {
  "use strict";
  document.addEventListener("click", function (event) {
    var toggle = event.target.closest("[data-toggle]");
    if (toggle) {
      var panel = document.querySelector(toggle.getAttribute("data-toggle"));
      if (panel) {
        panel.hidden = !panel.hidden;
        if (!panel.hidden) {
          var first = panel.querySelector("input:not([type=hidden]), select");
          if (first) first.focus();
        }
      }
      return;
    }
    var copy = event.target.closest("[data-copy]");
    if (copy) {
      var source = document.querySelector(copy.getAttribute("data-copy"));
      if (source && navigator.clipboard) {
        navigator.clipboard.writeText(source.textContent.trim()).then(function () {
          var label = copy.textContent;
          copy.textContent = "Copied";
          setTimeout(function () { copy.textContent = label; }, 1500);
        });
      }
    }
  });
})();
