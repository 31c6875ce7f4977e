"""The package version, in a module of its own so that any module can import it without importing the package
namespace (rlflow/__init__.py exports the Python API, which imports most of rlflow)."""

__version__ = "0.1.0"
