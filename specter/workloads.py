"""Built-in prompt sets for `specter bench --workload NAME`.

`default`: four short prompts in the style of the bundled model's training text (the Python
standard library). Its greedy continuations are repetitive, which flatters every speculative number.

`diverse`: prompts written for this purpose, in domains the bundled model never saw (it was
trained on the standard library only): data analysis, web back ends, machine learning, games,
science, finance, bioinformatics, embedded, infrastructure, plus prose in docstrings and
comments. Different prompts route to different experts, so a cycle's union of experts is wider
and one verification amortises less: the honest workload for speculative offloading, and meant
to be sampled (`--temperature 1.0 --top-p 0.95`) as well as run greedily.
"""
from __future__ import annotations

from .errors import ConfigError

DEFAULT = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "import os\n\ndef read_lines(path):",
)

DIVERSE = (
    # data analysis
    "import pandas as pd\n\nsales = pd.read_csv(\"sales_2023.csv\", parse_dates=[\"order_date\"])\n"
    "monthly = sales.groupby(sales.order_date.dt.to_period(\"M\"))",
    # web back end
    "from flask import Flask, jsonify, request\n\napp = Flask(__name__)\n\n"
    "@app.route(\"/api/orders/<int:order_id>\", methods=[\"GET\", \"DELETE\"])\ndef order(order_id):",
    # ORM model
    "from django.db import models\n\n\nclass Invoice(models.Model):\n"
    "    customer = models.ForeignKey(\"Customer\", on_delete=models.CASCADE)\n    issued_at =",
    # machine learning
    "for epoch in range(num_epochs):\n    model.train()\n    for images, labels in train_loader:\n"
    "        optimizer.zero_grad()\n        logits = model(images.to(device))",
    # a game loop
    "import pygame\n\npygame.init()\nscreen = pygame.display.set_mode((800, 600))\n"
    "player = pygame.Rect(380, 500, 40, 40)\nwhile running:\n    for event in pygame.event.get():",
    # scientific computing
    "import numpy as np\nfrom scipy.integrate import solve_ivp\n\n\n"
    "def lorenz(t, state, sigma=10.0, rho=28.0, beta=8 / 3):\n"
    "    \"\"\"Right-hand side of the Lorenz system.\"\"\"\n    x, y, z = state",
    # finance
    "def amortization_schedule(principal, annual_rate, years):\n"
    "    \"\"\"Yield (month, interest, principal_paid, balance) for a fixed-rate mortgage.\"\"\"\n"
    "    monthly_rate = annual_rate / 12",
    # bioinformatics
    "CODON_TABLE = {\"ATG\": \"M\", \"TGG\": \"W\", \"TAA\": \"*\", \"TAG\": \"*\", \"TGA\": \"*\"}\n\n\n"
    "def translate(dna):\n    protein = []\n    for i in range(0, len(dna) - 2, 3):",
    # embedded (MicroPython)
    "from machine import Pin, I2C\nimport time\n\ni2c = I2C(0, scl=Pin(22), sda=Pin(21), freq=400000)\n"
    "BME280_ADDR = 0x76\n\ndef read_temperature():",
    # infrastructure / async client
    "import asyncio\nimport aiohttp\n\n\nasync def fetch_all(urls, concurrency=8):\n"
    "    semaphore = asyncio.Semaphore(concurrency)\n    async with aiohttp.ClientSession() as session:",
    # prose in a docstring
    "def recommend_playlist(listening_history, mood):\n    \"\"\"Pick songs for a road trip.\n\n"
    "    The user has been listening mostly to jazz this week, but said they feel energetic today, so",
    # a command-line tool with argument parsing
    "import click\n\n\n@click.command()\n@click.option(\"--city\", required=True, help=\"City to forecast.\")\n"
    "@click.option(\"--days\", default=3)\ndef forecast(city, days):\n    \"\"\"Print a weather forecast.\"\"\"",
)

WORKLOADS = {"default": DEFAULT, "diverse": DIVERSE}


def workload_prompts(name: str) -> list[str]:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)} (or pass --prompts FILE)")
    return list(WORKLOADS[name])
