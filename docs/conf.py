"""Sphinx configuration for the attnflow documentation.

Build from the repository root, against the installed package:

    sphinx-build -W --keep-going -b html docs docs/_build/html

The API pages are generated from the docstrings of the installed ``attnflow``; this file
does not put the repository on ``sys.path``. No extension reaches the network at build
time (no intersphinx), and none is needed to read the site: MathJax is served from the
site itself (``sphinx-mathjax-offline`` copies MathJax 3.2.2 into ``_static/mathjax``).
"""

from __future__ import annotations

from importlib.metadata import version as _version

# -- Project -------------------------------------------------------------------------------

project = "attnflow"
author = "The attnflow developers"
copyright = "The attnflow developers"
release = _version("attnflow")  # of the installed distribution; fails loudly if missing
version = ".".join(release.split(".")[:2])

# -- General -------------------------------------------------------------------------------

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # sets mathjax_path to the copy it puts in _static
    "matplotlib.sphinxext.plot_directive",  # the gallery's figures are drawn at build time
]

plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# `name` in a docstring (a parameter, an option value) renders as inline code.
default_role = "code"
# Option values such as "mean" keep their straight quotes in parameter types.
smartquotes = False

# -- MyST ----------------------------------------------------------------------------------

myst_enable_extensions = [
    "amsmath",  # \begin{align} ... \end{align} blocks
    "colon_fence",  # ::: fences for admonitions
    "deflist",
    "dollarmath",  # $inline$ and $$display$$ maths
]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# -- autodoc / autosummary -----------------------------------------------------------------

autosummary_generate = True
autosummary_imported_members = True
# The signature shows names and defaults; types are documented in the numpydoc
# Parameters section, where they read as prose rather than as expanded type aliases.
autodoc_typehints = "none"
autodoc_default_options = {"members": False}

# -- numpydoc ------------------------------------------------------------------------------

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_use_plots = False
numpydoc_attributes_as_param_list = True
# Check the documented docstrings against numpydoc's rules at build time; with -W a failed
# check is an error. Left out: GL08 (object without a docstring), ES01 (no extended
# summary), SA01 (no See Also section) and SA04 (a See Also entry without a description).
numpydoc_validation_checks = {"all", "GL08", "ES01", "SA01", "SA04"}

# -- HTML ----------------------------------------------------------------------------------

html_theme = "pydata_sphinx_theme"
html_title = f"attnflow {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 7,
    "secondary_sidebar_items": ["page-toc", "sourcelink"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"**": []}
html_show_sourcelink = True
html_static_path: list[str] = []
# The methods of attnflow.html.TokenView and InteractiveView are shown in their examples.
numpydoc_validation_exclude = {
    r"\.TokenView\.\w+$",
    r"\.InteractiveView\.\w+$",
    r"\.Explanation\.\w+$",  # methods documented in one line each, as TokenView's
    # A NamedTuple: its fields and tuple methods (count, index) carry generated docstrings.
    r"\.EncoderDecoderAttribution\.\w+$",
}
