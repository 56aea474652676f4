"""skyrl-envs registrations. Light: only records here; the environments load on first use."""

from skyrl_core.plugins import hookimpl
from skyrl_core.plugins.records import EnvironmentSpec

ENVIRONMENTS = (
    ("arithmetic", "arithmetic:ArithmeticEnv", "arithmetic:ArithmeticOptions",
     "What is a + b? Reward 1 for the right integer (the quickstart task)"),
    ("gsm8k", "math_env:GSM8KEnv", "math_env:GSM8KOptions",
     "grade-school math; '#### x' answers, math-verify/sympy equivalence; optional retries"),
    ("math", "math_env:MathEnv", "math_env:MathOptions",
     "competition math; \\boxed{x} answers, math-verify/sympy equivalence; optional retries"),
    ("sql", "sql_env:SQLEnv", "sql_env:SQLOptions",
     "text-to-SQL on a read-only SQLite database with an <sql> tool; result-set reward"),
    ("search", "search_env:SearchEnv", "search_env:SearchOptions",
     "question answering with a <search> tool over a local FTS5 index; exact-match reward"),
    ("code", "code_env:CodeEnv", "code_env:CodeOptions",
     "Python programs run sandboxed against stdin/stdout tests; reward = fraction passed"),
    ("multi_tool", "multi_tool_env:MultiToolEnv", "multi_tool_env:MultiToolOptions",
     "question answering with <search> and <python> tools"),
)


@hookimpl
def skyrl_register_environments(register):
    for name, factory, options, description in ENVIRONMENTS:
        register(EnvironmentSpec(name=name, factory=f"skyrl_envs.{factory}", options=f"skyrl_envs.{options}",
                                 description=description))
