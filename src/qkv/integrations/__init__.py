"""Integrations with other libraries; each imports its library only when used."""
