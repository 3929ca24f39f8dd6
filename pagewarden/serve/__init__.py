"""Scale-out: pagewarden replicas on Ray Serve (``pip install pagewarden[ray]``).

``ray.py`` builds the Serve application (an ingress running the OpenAI routes of
``pagewarden.server`` and one engine per replica); ``router.py`` is the prefix-aware
request router; ``remote_engine.py`` carries requests to replicas and migrates them when
a replica dies. Only ``ray.py``, ``router.py`` and ``board.py`` import Ray.
"""
