"""Integrations with other libraries. Each imports its library only when used."""
