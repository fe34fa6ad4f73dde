"""The plan shown to its reader: reports and verdicts (report), the view both pictures draw
(render), Graphviz (dot), the HTML page (page, with page.css and page.js), and why a layout
was chosen, each candidate forced and re-planned (explain)."""
