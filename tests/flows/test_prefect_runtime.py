"""What flows.prefect_runtime and flows.prefect_flow change in Prefect gives what Prefect
gives: each flow's parameter schema, and the settings its logging.yml is filled from."""

from __future__ import annotations

import pytest


def test_a_flows_parameter_schema_is_prefects_made_when_first_read() -> None:
    from prefect import Flow, flow
    from prefect.utilities.callables import parameter_schema

    import flows.pipeline

    ours = [value for value in vars(flows.pipeline).values() if isinstance(value, Flow)]
    assert sorted(f.name for f in ours) == [
        "shardflow-catalog-verify",
        "shardflow-ingest",
        "shardflow-pipeline",
        "shardflow-preprocess",
        "shardflow-train",
    ]
    for made in ours:
        assert not hasattr(made.__dict__.get("parameters"), "properties")  # not made yet
        assert made.parameters == parameter_schema(made.fn)
        assert made.parameters is made.parameters  # made once
        assert "home" in made.parameters.properties

    # A copy made before its schema was (cloudpickle, as Prefect ships a flow) makes it too.
    import cloudpickle

    from flows.prefect_flow import flow as our_flow

    @our_flow(name="shardflow-test-pickled")
    def pickled(rows: int = 5) -> int:
        return rows

    copy = cloudpickle.loads(cloudpickle.dumps(pickled))
    assert copy.__dict__["parameters"] is None
    assert copy.parameters.properties["rows"]["default"] == 5

    # A flow defined with Prefect's own decorator, here, still gets its schema at once.
    @flow(name="shardflow-test-prefects-own")
    def prefects_own(rows: int = 3) -> int:
        return rows

    assert prefects_own.__dict__["parameters"] == parameter_schema(prefects_own.fn)
    assert prefects_own.parameters.properties["rows"]["default"] == 3


def test_logging_yml_is_filled_from_the_settings_prefect_serialises() -> None:
    from prefect.logging import configuration
    from prefect.settings import get_current_settings

    import flows.pipeline  # noqa: F401  (applies logging_settings_on_demand)
    from flows.prefect_runtime import SettingsEnvironment, logging_settings_on_demand

    assert logging_settings_on_demand()
    assert isinstance(
        configuration.get_current_settings().to_environment_variables(include_aliases=True),
        SettingsEnvironment,
    )
    settings = get_current_settings()
    every = settings.to_environment_variables(include_aliases=True)
    on_demand = SettingsEnvironment(settings)
    for name, value in every.items():
        assert on_demand[name] == value, name
    assert dict(on_demand) == every
    with pytest.raises(KeyError):
        on_demand["PREFECT_NOT_A_SETTING"]
    # Anything else asked of the settings there is Prefect's.
    assert configuration.get_current_settings().logging.level == settings.logging.level
