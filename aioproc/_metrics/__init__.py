"""Metrics: the recorder's hooks, metric families, the text format, the exporters.

``hooks`` is the only module the launcher imports (it imports nothing), so a
process that never enables metrics pays for one small module and one
attribute check per event; everything else loads with ``aioproc.metrics``.
"""
