"""Sphinx's settings for the course's website (``make site``; ``docs/website/build.py`` writes the pages).

The pages are the notebooks as they ran (MyST-NB reads their outputs and never executes them), the course
index as the home page, and a few pages of Markdown.  Everything a page loads is served from the site
itself: the theme's files, the search index, MathJax (``sphinx-mathjax-offline``), the replays' frames —
no CDN, so the site works offline, from ``file://`` and behind a firewall, and a browser reports no
failed request.
"""
from __future__ import annotations

import os

project = "Splitting the Work"
author = "Splitting the Work contributors"
copyright = "Splitting the Work contributors — code Apache-2.0, lectures' prose and figures CC BY 4.0"
release = version = os.environ.get("COURSE_SITE_VERSION", "")

extensions = ["myst_nb", "sphinx-mathjax-offline"]
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# MyST: $…$ and $$…$$ maths as the notebooks write it; heading anchors for in-page links; {{ version }}
myst_enable_extensions = ["dollarmath", "amsmath", "substitution"]
myst_heading_anchors = 3
myst_substitutions = {"version": version}

# MyST-NB: show what the notebooks printed and drew, never run them again
nb_execution_mode = "off"
nb_merge_streams = True
# a replay carries a widget (nothing to drive it here), a self-contained HTML animation and a PNG: prefer the
# animation, and load no widget manager (its scripts come from a CDN)
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_ipywidgets_js = {}

html_theme = "sphinx_book_theme"
html_title = "Splitting the Work"
html_favicon = "favicon.svg"      # (without one, a browser's request for /favicon.ico fails on every page)
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_context = {"default_mode": "light"}    # (unset, the theme logs a console error on every page)
html_copy_source = False          # the pages are the sources a reader needs
html_show_sourcelink = False
html_last_updated_fmt = None
