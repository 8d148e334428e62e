"""The learning wing: the seeds' stages (``tutorial``), every step of one call printed
(``explain``) and heatmaps (``viz``)."""
