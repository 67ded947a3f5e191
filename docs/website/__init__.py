"""The course's website (``make site``): ``build`` runs the steps (the student release, its notebooks
executed, the pages, Sphinx, the checks), ``pages`` turns executed notebooks into the site's pages,
``check`` finds solution lines and broken links in a built site, ``conf`` is Sphinx's configuration;
``run_it_yourself.md`` is a page of its own (the papers are ``docs/references.md``)."""
