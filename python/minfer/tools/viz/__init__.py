"""The `minfer viz` server and its page (page.html, package data)."""
