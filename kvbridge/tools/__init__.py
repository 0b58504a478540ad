"""kvbridge's workshop: the CLI, benches, demo, doctor, simulator, deploy checks and the harness
that starts real engines. An engine never imports anything here (tests/unit/test_rooms.py checks:
nothing outside ``kvbridge/tools/`` imports ``kvbridge.tools``)."""
