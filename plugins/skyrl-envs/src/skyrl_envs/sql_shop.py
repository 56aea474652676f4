"""The shop database shipped as test and demo data for the ``sql`` environment.

``build_shop_database(path)`` writes it deterministically (a seeded generator, fixed insertion
order), and ``shop_rows()`` gives the text-to-SQL questions with their gold queries as dataset
rows. The built files live in ``skyrl_envs/data/sql/`` (``shop.sqlite``, ``shop.jsonl``);
rebuild them with ``python -m skyrl_envs.build_data``. A test checks the shipped database has the
content this builder makes.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).with_name("data") / "sql"

SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, joined_year INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     order_date TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id),
                          product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL,
                          PRIMARY KEY (order_id, product_id));
"""

FIRST_NAMES = ["Ana", "Bruno", "Chloe", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ivo", "Jun",
               "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Lima"]
PRODUCTS = [("notebook", "stationery", 3.5), ("fountain pen", "stationery", 24.0), ("stapler", "stationery", 9.25),
            ("desk lamp", "home", 31.0), ("kettle", "home", 27.5), ("mug", "home", 6.0), ("rug", "home", 89.0),
            ("atlas", "books", 45.0), ("cookbook", "books", 19.99), ("novel", "books", 12.5),
            ("headphones", "electronics", 59.0), ("charger", "electronics", 15.0), ("keyboard", "electronics", 42.0),
            ("tent", "outdoor", 120.0), ("water bottle", "outdoor", 11.0)]
STATUSES = ["delivered", "delivered", "delivered", "shipped", "cancelled"]

QUESTIONS = [
    ("How many customers live in Lisbon?", "SELECT COUNT(*) FROM customers WHERE city = 'Lisbon'"),
    ("List the names of all products in the books category.", "SELECT name FROM products WHERE category = 'books'"),
    ("What is the name of the most expensive product?", "SELECT name FROM products ORDER BY price DESC LIMIT 1"),
    ("How many orders have each status? Give the status and the count.",
     "SELECT status, COUNT(*) FROM orders GROUP BY status"),
    ("Which customers joined in 2021? Give their names.", "SELECT name FROM customers WHERE joined_year = 2021"),
    ("Which city has the most customers?",
     "SELECT city FROM customers GROUP BY city ORDER BY COUNT(*) DESC, city LIMIT 1"),
    ("What is the total revenue (price times quantity) of delivered orders?",
     "SELECT ROUND(SUM(p.price * i.quantity), 2) FROM order_items i JOIN products p ON p.id = i.product_id "
     "JOIN orders o ON o.id = i.order_id WHERE o.status = 'delivered'"),
    ("Which customers never placed an order? Give their names.",
     "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)"),
    ("What is the average product price in each category?",
     "SELECT category, ROUND(AVG(price), 2) FROM products GROUP BY category"),
    ("How many units of the kettle were ordered in total?",
     "SELECT SUM(i.quantity) FROM order_items i JOIN products p ON p.id = i.product_id WHERE p.name = 'kettle'"),
    ("How many orders were placed in 2023?", "SELECT COUNT(*) FROM orders WHERE order_date LIKE '2023-%'"),
    ("Which customer placed the most orders? Give the name.",
     "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id "
     "ORDER BY COUNT(*) DESC, c.name LIMIT 1"),
]

INSTRUCTIONS = (
    "You answer questions about a SQLite database. To look at the data, write one query as "
    "<sql>SELECT ...</sql> and you will be shown its result. When you know the answer, give the "
    "final query that returns it as <solution>SELECT ...</solution>."
)


def build_shop_database(path: str | Path) -> Path:
    """Write the shop database to ``path`` (replacing it); the same content on every call."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    rng = random.Random(20240601)
    connection = sqlite3.connect(path)
    with connection:
        connection.executescript(SCHEMA)
        for index, name in enumerate(FIRST_NAMES, start=1):
            connection.execute("INSERT INTO customers VALUES (?, ?, ?, ?)",
                               (index, name, rng.choice(CITIES), rng.randint(2018, 2023)))
        for index, (name, category, price) in enumerate(PRODUCTS, start=1):
            connection.execute("INSERT INTO products VALUES (?, ?, ?, ?)", (index, name, category, price))
        buyers = list(range(1, len(FIRST_NAMES) - 3))  # the last customers never order
        for order_id in range(1, 61):
            date = f"{rng.randint(2021, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            connection.execute("INSERT INTO orders VALUES (?, ?, ?, ?)",
                               (order_id, rng.choice(buyers), date, rng.choice(STATUSES)))
            for product_id in sorted(rng.sample(range(1, len(PRODUCTS) + 1), rng.randint(1, 3))):
                connection.execute("INSERT INTO order_items VALUES (?, ?, ?)",
                                   (order_id, product_id, rng.randint(1, 4)))
    connection.execute("VACUUM")
    connection.close()
    return path


def schema_text(path: str | Path) -> str:
    """The ``CREATE TABLE`` statements of a database, for prompts."""
    connection = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        rows = connection.execute("SELECT sql FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
    finally:
        connection.close()
    return "\n".join(row[0].strip() + ";" for row in rows)


def shop_rows(db_path: str | Path = DATA_DIR / "shop.sqlite") -> list[dict[str, Any]]:
    """The shop questions as ``sql`` dataset rows (``db_id = "shop"``)."""
    schema = schema_text(db_path)
    return [
        {
            "prompt": [{"role": "system", "content": INSTRUCTIONS},
                       {"role": "user", "content": f"Database schema:\n{schema}\n\nQuestion: {question}"}],
            "env_class": "sql",
            "db_id": "shop",
            "reward_spec": {"ground_truth": gold},
            "extra_info": {"question": question, "index": index},
        }
        for index, (question, gold) in enumerate(QUESTIONS)
    ]

