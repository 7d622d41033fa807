"""Sluice's HTTP API: OpenAI's Files and Batches, plus native single jobs and progressive results.

``create_app()`` in ``sluice.api.app`` builds it; ``sluice serve`` runs it under uvicorn.
"""
