"""Trained parts that ship as Hub-style folders: draft heads (EAGLE/HASS, Lyanna) and exit heads."""
