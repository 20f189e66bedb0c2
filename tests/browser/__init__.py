"""Helpers for tests/test_browser.py: a throwaway JupyterLab server, and driving a notebook page."""
